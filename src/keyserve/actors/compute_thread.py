"""One thread for all of an actor's torch work, whichever thread asks for it, and the thread
that serves the actor's step channel itself.

Why one thread: libgomp keeps a pool of OpenMP threads per thread that starts a parallel
region, and once the threads of all pools outnumber the CPUs it stops spinning at barriers and
sleeps on a futex at each one (its "throttled" spin count). A shard loads its model on the
actor's main thread (a Ray call) and then runs its steps on another: a step channel's thread,
or the compiled graph's loop thread. That made two pools, four OpenMP threads on two cores, and
every step of the barrier-heavy native decode paid ~160 context switches: measured on the
2-core EPYC (the same decode step, SmolLM2 float32, 2 threads, in one process), 1 context
switch and 18.5-21.3 ms per step with one pool, 154-165 and 22.4-23.9 ms once a second thread
had run a parallel region. With every torch call on this one thread there is one pool,
whichever path the step came by.

Why it serves the channel too: handing each step from the channel's thread to this one and
the reply back costs two thread wake-ups per step (measured: the channel path's orchestration
rose from 0.99 / 1.55 ms to 1.17 / 1.75 ms per step at batch 1 / 16 when the hand-off came in).
So the thread waits in one ``select`` on its work queue's wake-up socket and on every adopted
channel connection, and runs a step that arrives on a connection where it arrives.

Everything it runs runs under ``lock`` (the actor's lock, which its Ray-called methods that do
no torch work take directly), taken on this thread (a channel's handler, by the channel's
server): a caller never holds the lock while it waits for this thread, so the two cannot
deadlock.
"""

from __future__ import annotations

import logging
import queue
import selectors
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class ComputeThread:
    """Runs callables on one persistent thread and waits for their result (or exception); serves
    connections handed to ``adopt`` on the same thread."""

    def __init__(self, lock: threading.RLock | None = None) -> None:
        self.lock = lock or threading.RLock()
        self._work: queue.SimpleQueue[tuple[Callable[..., Any], tuple, Future]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="keyserve-compute")
        self._thread.start()

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        if threading.current_thread() is self._thread:
            with self.lock:
                return fn(*args)
        done: Future = Future()
        self._work.put((fn, args, done))
        self._wake_w.send(b"\0")
        return done.result()

    def adopt(self, conn: socket.socket, serve_one: Callable[[socket.socket], bool]) -> None:
        """Serve ``conn`` on this thread: ``serve_one(conn)`` whenever it is readable (it takes
        the lock around its handler); when it returns False the connection is dropped (and
        closed)."""
        self.run(self._selector.register, conn, selectors.EVENT_READ, serve_one)

    def _loop(self) -> None:
        while True:
            for key, _ in self._selector.select():
                if key.data is None:
                    self._run_queued()
                    continue
                conn: socket.socket = key.fileobj  # type: ignore[assignment]
                if not self._serve(key.data, conn):
                    self._selector.unregister(conn)
                    conn.close()

    @staticmethod
    def _serve(serve_one: Callable[[socket.socket], bool], conn: socket.socket) -> bool:
        """One message on ``conn`` (the handler takes the lock itself: ``ChannelServer._reply``);
        False drops the connection. Whatever escapes the server drops that connection only: this
        thread is every later step's, and an exception ending it would leave the actor alive
        but never answering again."""
        try:
            return serve_one(conn)
        except Exception:  # noqa: BLE001 — logged; the sender sees its channel closed
            log.exception("step channel: serving a message failed; the connection is dropped")
            return False

    def _run_queued(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                fn, args, done = self._work.get_nowait()
            except queue.Empty:
                return
            if not done.set_running_or_notify_cancel():
                continue
            try:
                with self.lock:
                    done.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 — the caller raises it
                done.set_exception(e)
