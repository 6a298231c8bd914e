"""``ComputeThread``: an actor's torch work runs on one thread whichever thread asks (one
libgomp pool per process, actors/compute_thread.py), with results and exceptions returned."""

from __future__ import annotations

import threading

import pytest

from keyserve.actors.compute_thread import ComputeThread
from keyserve.actors.step_channel import TOKEN_BYTES, ChannelClient, ChannelEndpoint, encode

TOKEN = b"c" * TOKEN_BYTES


def _call(client: ChannelClient, method: str, *args):
    client.send(encode((method, args)))
    return client.recv()


def test_calls_from_any_thread_run_on_the_same_one() -> None:
    compute = ComputeThread()
    seen = [compute.run(threading.get_ident)]
    callers = [threading.Thread(target=lambda: seen.append(compute.run(threading.get_ident))) for _ in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert len(seen) == 4 and len(set(seen)) == 1
    assert seen[0] != threading.get_ident()  # not the caller's


def test_results_and_exceptions_come_back() -> None:
    compute = ComputeThread()
    assert compute.run(lambda a, b: a * b, 6, 7) == 42

    def fail() -> None:
        raise KeyError("no such sequence")

    with pytest.raises(KeyError, match="no such sequence"):
        compute.run(fail)
    assert compute.run(sum, [1, 2]) == 3  # still serving


def test_the_step_channel_is_served_on_the_compute_thread() -> None:
    """No hand-off between threads: the handler runs on the thread that runs the torch work,
    and may itself call ``run`` (inline, not queued behind itself)."""
    compute = ComputeThread()
    endpoint = ChannelEndpoint(compute)
    assert endpoint.lock is compute.lock
    address = endpoint.open("127.0.0.1", TOKEN, {
        "where": threading.get_ident,
        "nested": lambda: compute.run(threading.get_ident),
    })
    client = ChannelClient(address, TOKEN)
    home = compute.run(threading.get_ident)
    assert _call(client, "where") == home
    assert _call(client, "nested") == home


def test_work_from_other_threads_runs_while_a_channel_is_open() -> None:
    """An idle adopted connection does not keep queued work (a Ray-called method's) waiting,
    and a held lock makes both wait: everything on the thread runs under the actor's lock."""
    compute = ComputeThread()
    endpoint = ChannelEndpoint(compute)
    client = ChannelClient(endpoint.open("127.0.0.1", TOKEN, {"echo": lambda x: x}), TOKEN)
    assert _call(client, "echo", 1) == 1
    assert compute.run(lambda: 5) == 5
    ran = threading.Event()
    with compute.lock:
        worker = threading.Thread(target=lambda: (compute.run(lambda: None), ran.set()))
        worker.start()
        assert not ran.wait(0.2)
    assert ran.wait(5)
    assert _call(client, "echo", 2) == 2
    client.close()
    assert compute.run(lambda: 6) == 6  # a closed connection is dropped, the thread goes on


def test_a_connection_whose_serving_fails_is_dropped_and_the_thread_goes_on() -> None:
    """Whatever escapes a connection's server drops that connection, not the thread every
    later step runs on (an exception that ended it left the actor alive, never answering)."""
    import socket

    compute = ComputeThread()
    ours, theirs = socket.socketpair()

    def serve_one(conn: socket.socket) -> bool:
        conn.recv(1)
        raise ValueError("a bug in serving")

    compute.adopt(ours, serve_one)
    theirs.settimeout(30)
    theirs.sendall(b"x")
    assert theirs.recv(1) == b""  # dropped: closed on our side
    names: list[str] = []
    caller = threading.Thread(target=lambda: names.append(compute.run(lambda: threading.current_thread().name)),
                              daemon=True)
    caller.start()
    caller.join(30)  # a dead compute thread would leave the caller waiting forever
    assert names == ["keyserve-compute"]
