"""Direct step channels: the plain step path's per-step calls over one socket per actor.

Why: a Ray actor call costs ~1 ms on a small CPU node (2-core EPYC: 0.89 ms bare, 2-3 ms
beside a busy shard), two of them per step (the KV-block manager, then the target group). A
compiled graph's shared-memory channels are cheaper, but their readers busy-wait on the cores
the shards compute on (``step_graph.use_compiled_graph``). A socket read blocks in the kernel:
a round trip costs ~40 us and nobody spins.

Ray still creates, places, restarts and pings the actors; only the step's request and reply
travel here. An actor opens its listener on its node's address when the engine first asks
(``ChannelServer``), and accepts only a connection that presents the engine's random token
first. The handler runs under the actor's lock, so it never overlaps the actor's Ray-called
methods: on the connection's own thread, or, for an actor with a ``ComputeThread`` (the shards
and the draft actor), on that thread, which then reads the socket itself (no hand-off between
threads on the step's way in or out). A dead actor closes its socket: the engine sees end-of-file at
once (``ChannelClosed``), where a Ray call would raise an actor error.

Messages are length-prefixed pickles: ``(method, args)`` one way, ``(ok, value)`` back, where a
handler's exception travels as the value and is raised again in the caller.
"""

from __future__ import annotations

import functools
import hmac
import logging
import pickle
import select
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keyserve.actors.compute_thread import ComputeThread

log = logging.getLogger(__name__)

TOKEN_BYTES = 32
# A connection's role, the byte after its token. A call's reply goes back on its own connection;
# the engine's destination connection also receives the replies to relayed messages, which
# another actor sends on a relay connection (``channel_graph.py``: the KV-block manager hands
# the step to the shards, which answer the engine).
CALL, DESTINATION, RELAY = b"C", b"D", b"R"
ROLES = (CALL, DESTINATION, RELAY)
# The actor's answer to a handshake, once the connection is served (and a destination is known
# as such): a relayed message can never arrive before its destination is.
ACCEPTED = b"A"
_HEADER = struct.Struct("<Q")
_SMALL = 1 << 16  # below this a message goes out in one write (header and body together)


class ChannelClosed(ConnectionError):
    """The actor's end is gone (its process died or closed the connection)."""


def _tuned(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a step is one small write
    return sock


def encode(message: object) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(payload: bytes) -> Any:
    """``encode``'s inverse (a message read whole, or one carried inside another)."""
    return pickle.loads(payload)


def _send(sock: socket.socket, payload: bytes) -> None:
    header = _HEADER.pack(len(payload))
    if len(payload) < _SMALL:
        sock.sendall(header + payload)
    else:
        sock.sendall(header)
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ChannelClosed("the actor closed its step channel")
        got += k
    return buf


def _recv_frame(sock: socket.socket) -> bytearray:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return _recv_exact(sock, n)


def _recv(sock: socket.socket) -> object:
    return decode(_recv_frame(sock))


def _request(frame: bytearray) -> tuple[str, tuple]:
    """A message as ``(method, args)``; ``UnreadableMessage`` for one that does not unpickle
    here (e.g. a class this process cannot import) or is not such a pair. The frame was read
    whole, so the connection stays in step for the next message."""
    try:
        method, args = decode(frame)
    except Exception as e:  # noqa: BLE001 — whatever unpickling raises, the sender hears it
        raise UnreadableMessage(f"the actor could not read the message: {type(e).__name__}: {e}") from None
    if not isinstance(method, str) or not isinstance(args, tuple):
        raise UnreadableMessage(f"the actor could not read the message: not a (method, args) pair "
                                f"but ({type(method).__name__}, {type(args).__name__})")
    return method, args


class UnreadableMessage(RuntimeError):
    """A step-channel message the actor could not decode (answered to its sender)."""


class ChannelServer:
    """An actor's listener: serves ``handlers`` (method name -> callable) under ``lock`` (the
    one the actor's Ray-called methods take), on ``compute``'s thread when there is one."""

    def __init__(self, host: str, token: bytes, handlers: dict[str, Callable[..., Any]],
                 lock: threading.RLock, compute: ComputeThread | None = None) -> None:
        self.token, self.handlers, self.lock, self.compute = token, handlers, lock, compute
        self.destination: socket.socket | None = None  # where relayed messages are answered
        self._send_lock = threading.Lock()
        self.listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self.listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True, name="keyserve-step-channel").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(_tuned(conn),), daemon=True,
                             name="keyserve-step-channel-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(30.0)
                hello = bytes(_recv_exact(conn, TOKEN_BYTES + 1))
                token, role = hello[:TOKEN_BYTES], hello[TOKEN_BYTES:]
                if not hmac.compare_digest(token, self.token):
                    log.warning("step channel: a connection without the engine's token was refused")
                    return
                if role not in ROLES:
                    log.warning("step channel: a connection with an unknown role %r was refused", role)
                    return
                conn.settimeout(None)
                kept = conn.dup() if self.compute is not None else conn
                if role == DESTINATION:
                    self.destination = kept
                serve_one = functools.partial(self._serve_one, relayed=role == RELAY)
                if self.compute is not None:
                    self.compute.adopt(kept, serve_one)
                    conn.sendall(ACCEPTED)
                    return
                conn.sendall(ACCEPTED)
                while serve_one(conn):
                    pass
            except (ChannelClosed, OSError):
                return  # the engine went away (or reconnects)

    def _serve_one(self, conn: socket.socket, relayed: bool = False) -> bool:
        """Read one message and answer it (a relayed one on the engine's destination
        connection); False once the sender went away (or reconnects)."""
        try:
            frame = _recv_frame(conn)
        except (ChannelClosed, OSError):
            return False
        try:
            method, args = _request(frame)
        except UnreadableMessage as e:
            log.warning("step channel: %s", e)
            method, payload = "?", encode((False, e))
        else:
            payload = self._reply(method, args)
        to = self.destination if relayed else conn
        if to is None:
            log.warning("step channel: a relayed %r has no engine to answer", method)
            return True
        try:
            with self._send_lock:
                _send(to, payload)
        except OSError:
            return relayed  # the engine went away; a relay stays for its next one
        return True

    def _reply(self, method: str, args: tuple) -> bytes:
        handler = self.handlers.get(method)
        if handler is None:
            return encode((False, UnreadableMessage(f"the actor has no handler {method!r}")))
        try:
            with self.lock:
                value = handler(*args)
            return encode((True, value))
        except Exception as e:  # noqa: BLE001 — the caller raises it
            try:
                return encode((False, e))
            except Exception:  # noqa: BLE001 — an exception that does not pickle
                return encode((False, RuntimeError(f"{type(e).__name__}: {e}")))

    def close(self) -> None:
        self.listener.close()


class ChannelEndpoint:
    """An actor's side: its lock (``compute``'s, when the actor has a compute thread) and,
    once the engine asks, its listener."""

    def __init__(self, compute: ComputeThread | None = None) -> None:
        self.compute = compute
        self.lock = compute.lock if compute is not None else threading.RLock()
        self.server: ChannelServer | None = None

    def open(self, host: str, token: bytes, handlers: dict[str, Callable[..., Any]]) -> tuple[str, int]:
        """The listener's address (a new engine client, a new token: a new listener)."""
        if self.server is None or self.server.token != token:
            if self.server is not None:
                self.server.close()
            self.server = ChannelServer(host, token, handlers, self.lock, self.compute)
        return self.server.address


class ChannelClient:
    """The engine's end of one actor's channel (or, ``role=RELAY``, another actor's: what it
    sends is answered to the engine)."""

    def __init__(self, address: tuple[str, int], token: bytes, connect_timeout_s: float = 30.0,
                 role: bytes = CALL) -> None:
        try:
            self.sock = _tuned(socket.create_connection(tuple(address), timeout=connect_timeout_s))
            self.sock.sendall(token + role)
            if self.sock.recv(1) != ACCEPTED:
                raise OSError("the actor refused the connection (a wrong token?)")
            self.sock.settimeout(None)
        except OSError as e:
            raise ChannelClosed(f"cannot reach the actor's step channel at {address}: {e}") from e

    def send(self, payload: bytes) -> None:
        """One encoded ``(method, args)`` (``encode``: encode once, send to many)."""
        try:
            _send(self.sock, payload)
        except OSError as e:
            raise ChannelClosed(f"the actor's step channel broke: {e}") from e

    def recv(self) -> Any:
        """The reply to the last message sent; a handler's exception is raised here."""
        try:
            ok, value = _recv(self.sock)  # type: ignore[misc]
        except OSError as e:
            raise ChannelClosed(f"the actor's step channel broke: {e}") from e
        if not ok:
            raise value
        return value

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def gather(clients: Sequence[ChannelClient], still_alive: Callable[[], bool], poll_s: float = 10.0) -> list[Any]:
    """Every client's reply, in order, read as each arrives. The first failure raises at once
    (a dead peer may leave the others hanging in a collective): ``ChannelClosed`` for a closed
    channel, or the handler's exception. ``still_alive`` is asked after each ``poll_s`` without a
    reply (a node that vanished closes nothing); False raises ``ChannelClosed``."""
    replies: dict[int, Any] = {}
    pending = {c.fileno(): i for i, c in enumerate(clients)}
    while pending:
        ready, _, _ = select.select(list(pending), [], [], poll_s)
        if not ready:
            if not still_alive():
                raise ChannelClosed("an actor stopped answering its step channel")
            continue
        for fd in ready:
            i = pending.pop(fd)
            replies[i] = clients[i].recv()
    return [replies[i] for i in range(len(clients))]
