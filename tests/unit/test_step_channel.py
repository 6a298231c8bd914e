"""The plain step path's socket channel (``actors/step_channel.py``), without Ray: a real
listener on a real socket. What the engine relies on: replies in order with their values, a
handler's exception raised in the caller, a stranger without the token refused, a dead end
seen at once as ``ChannelClosed``, and ``gather`` failing on the first failure without waiting
for the others. Every test runs twice: the handler on the connection's own thread (the
KV-block manager) and on an actor's ``ComputeThread``, which then reads the socket itself (the
shards, the draft actor)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from keyserve.actors.compute_thread import ComputeThread
from keyserve.actors.step_channel import (
    ACCEPTED, DESTINATION, TOKEN_BYTES, ChannelClient, ChannelClosed, ChannelEndpoint, encode, gather,
)

TOKEN = b"k" * TOKEN_BYTES


class Boom(ValueError):
    pass


SERVING = {"on": "connection thread"}


@pytest.fixture(autouse=True, params=["connection thread", "compute thread"])
def serving(request: pytest.FixtureRequest) -> str:
    SERVING["on"] = request.param
    return request.param


def _new_endpoint() -> ChannelEndpoint:
    return ChannelEndpoint(ComputeThread() if SERVING["on"] == "compute thread" else None)


def _endpoint(**handlers) -> tuple[ChannelEndpoint, tuple[str, int]]:
    endpoint = _new_endpoint()
    return endpoint, endpoint.open("127.0.0.1", TOKEN, handlers)


def _call(client: ChannelClient, method: str, *args):
    client.send(encode((method, args)))
    return client.recv()


def test_round_trips_carry_values_and_raise_handler_errors() -> None:
    def fail(x):
        raise Boom(f"bad {x}")

    big = bytes(range(256)) * 2048  # 512 KiB: header and body sent apart
    _, address = _endpoint(add=lambda a, b: a + b, echo=lambda x: x, fail=fail)
    client = ChannelClient(address, TOKEN)
    assert _call(client, "add", 2, 3) == 5
    assert _call(client, "echo", big) == big
    with pytest.raises(Boom, match="bad 7"):
        _call(client, "fail", 7)
    assert _call(client, "add", [1], [2]) == [1, 2]  # the channel survives a handler error
    client.close()


def test_an_unpicklable_error_still_arrives() -> None:
    class Local(Exception):  # defined in a function: pickle cannot find it
        pass

    def fail():
        raise Local("nope")

    _, address = _endpoint(fail=fail)
    client = ChannelClient(address, TOKEN)
    with pytest.raises(RuntimeError, match="Local: nope"):
        _call(client, "fail")


def test_a_message_the_actor_cannot_read_is_answered_with_an_error() -> None:
    """A message that does not unpickle in the actor (a class it cannot import), names no
    handler, or is not a ``(method, args)`` pair is answered with an error the caller raises,
    and the connection serves the next message. Before, the decoding error escaped the server:
    it closed the connection, and on a ``ComputeThread`` it ended the thread, so every later
    step of that actor waited forever."""
    import pickle

    _, address = _endpoint(add=lambda a, b: a + b)
    client = ChannelClient(address, TOKEN)
    unreadable = b"cnowhere.module\nThing\n."  # a pickle naming a class no actor can import
    with pytest.raises(ModuleNotFoundError):
        pickle.loads(unreadable)
    for payload, match in ((unreadable, "could not read"), (encode(("nope", ())), "no handler 'nope'"),
                           (encode(42), "could not read")):
        client.send(payload)
        with pytest.raises(RuntimeError, match=match):
            client.recv()
        assert _call(client, "add", 2, 3) == 5  # still served, on the same connection
    client.close()


def test_a_relayed_message_with_no_engine_to_answer_keeps_the_relay() -> None:
    """A relayed message that arrives before the engine's destination connection has nobody to
    answer: it is logged and the relay connection serves on (the next message, once the
    destination is there, is answered on it), readable or not."""
    from keyserve.actors.step_channel import RELAY

    served = threading.Event()
    _, address = _endpoint(add=lambda a, b: a + b, mark=served.set)
    relay = ChannelClient(address, TOKEN, role=RELAY)
    relay.send(encode(("add", (1, 2))))
    relay.send(b"cnowhere.module\nThing\n.")  # unreadable, and nobody to tell
    relay.send(encode(("mark", ())))
    assert served.wait(30)  # all three handled before the engine connects
    destination = ChannelClient(address, TOKEN, role=DESTINATION)
    relay.send(encode(("add", (2, 3))))
    assert destination.recv() == 5


def test_a_connection_without_the_token_is_refused() -> None:
    _, address = _endpoint(echo=lambda x: x)
    with pytest.raises(ChannelClosed, match="refused"):
        ChannelClient(address, b"x" * TOKEN_BYTES)
    assert _call(ChannelClient(address, TOKEN), "echo", 2) == 2  # the listener still serves


def test_a_closed_listener_and_a_dropped_connection_are_channel_closed() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    accepted: list[socket.socket] = []

    def accept() -> None:
        conn = listener.accept()[0]
        conn.recv(TOKEN_BYTES + 1)
        conn.sendall(ACCEPTED)
        accepted.append(conn)

    t = threading.Thread(target=accept)
    t.start()
    client = ChannelClient(address, TOKEN)
    t.join()
    accepted[0].close()  # the actor's process died: its end closes
    with pytest.raises(ChannelClosed):
        client.recv()
    listener.close()
    with pytest.raises(ChannelClosed):
        ChannelClient(address, TOKEN, connect_timeout_s=2.0)


def test_the_handler_holds_the_actors_lock() -> None:
    inside = threading.Event()
    release = threading.Event()

    def slow():
        inside.set()
        release.wait(5)
        return "done"

    endpoint, address = _endpoint(slow=slow)
    client = ChannelClient(address, TOKEN)
    client.send(encode(("slow", ())))
    assert inside.wait(5)
    assert not endpoint.lock.acquire(blocking=False)  # a Ray-called method would wait here
    release.set()
    assert client.recv() == "done"
    assert endpoint.lock.acquire(blocking=False)
    endpoint.lock.release()


def test_a_new_token_opens_a_new_listener() -> None:
    endpoint = _new_endpoint()
    first = endpoint.open("127.0.0.1", TOKEN, {"one": lambda: 1})
    assert endpoint.open("127.0.0.1", TOKEN, {"one": lambda: 1}) == first
    other = b"o" * TOKEN_BYTES
    second = endpoint.open("127.0.0.1", other, {"one": lambda: 1})
    assert second != first
    assert _call(ChannelClient(second, other), "one") == 1


def test_gather_orders_replies_and_stops_at_the_first_failure() -> None:
    gate = threading.Event()
    _, fast = _endpoint(go=lambda x: x)
    _, slow = _endpoint(go=lambda x: (gate.wait(5), x)[1])
    a, b = ChannelClient(slow, TOKEN), ChannelClient(fast, TOKEN)
    a.send(encode(("go", ("slow",))))
    b.send(encode(("go", ("fast",))))
    threading.Timer(0.2, gate.set).start()
    assert gather([a, b], lambda: True) == ["slow", "fast"]  # in the clients' order

    def fail():
        raise Boom("rank 1")

    answered = threading.Event()

    def hang():
        gate.wait(30)
        answered.set()

    _, hung = _endpoint(go=hang)
    _, failing = _endpoint(go=fail)
    gate.clear()
    c, d = ChannelClient(hung, TOKEN), ChannelClient(failing, TOKEN)
    c.send(encode(("go", ())))
    d.send(encode(("go", ())))
    with pytest.raises(Boom, match="rank 1"):
        gather([c, d], lambda: True)
    assert not answered.is_set()  # raised without waiting for the hung peer
    gate.set()


def test_gather_asks_whether_a_silent_actor_is_alive() -> None:
    gate = threading.Event()
    _, address = _endpoint(go=lambda: gate.wait(30))
    client = ChannelClient(address, TOKEN)
    client.send(encode(("go", ())))
    asked = []

    def still_alive() -> bool:
        asked.append(1)
        return len(asked) < 2

    with pytest.raises(ChannelClosed, match="stopped answering"):
        gather([client], still_alive, poll_s=0.05)
    assert len(asked) == 2
    gate.set()


def _relay_shards(num_ranks: int, ran: list | None = None) -> tuple[list[ChannelClient], list[tuple[str, int]]]:
    """``num_ranks`` "shards" as the relayed graph connects them: rank 0 hands each
    ``graph_lead`` on to the others (``relay.hand_on``); each rank answers on the engine's
    destination connection. ``ran`` records (rank, step) as each runs it."""
    from keyserve.actors.relay import PEERS, Relay, hand_on

    def shard(rank: int):
        def graph_execute(step, probs):
            if ran is not None:
                ran.append((rank, step))
            if step == "BAD":
                raise Boom(f"rank {rank} failed")
            return (rank, step, probs)
        return graph_execute

    peers = Relay()
    ends = [_endpoint(graph_execute=shard(0), graph_lead=lambda frame, probs: shard(0)(hand_on(peers, frame), probs))]
    ends += [_endpoint(graph_execute=shard(r)) for r in range(1, num_ranks)]
    addresses = [address for _, address in ends]
    destinations = [ChannelClient(address, TOKEN, role=DESTINATION) for address in addresses]
    peers.connect(TOKEN, PEERS, addresses[1:])
    return destinations, addresses


def test_a_relayed_message_is_answered_to_the_engine() -> None:
    """The relayed step's plumbing (``channel_graph.py``): a head actor hands its input on over
    a relay connection to rank 0 of two "shards", which hands it on to rank 1 (the draft
    probabilities stay with rank 0); both answer on the engine's destination connections, not
    to the head; the head answers the engine itself. An error in a relayed handler reaches the
    engine too."""
    from keyserve.actors.relay import SHARDS, Relay

    destinations, addresses = _relay_shards(2)
    relay = Relay()

    def relay_step(request, batch):
        relay.to_shards(request.upper(), batch)
        return "scheduled " + request

    _, head = _endpoint(relay_step=relay_step)
    head_client = ChannelClient(head, TOKEN, role=DESTINATION)
    relay.connect(TOKEN, SHARDS, addresses[:1])
    clients = [head_client, *destinations]
    head_client.send(encode(("relay_step", ("step", "probs"))))
    assert gather(clients, lambda: False, poll_s=10) == ["scheduled step", (0, "STEP", "probs"), (1, "STEP", None)]
    head_client.send(encode(("relay_step", ("bad", None))))
    with pytest.raises(Boom, match="rank"):
        gather(clients[1:], lambda: False, poll_s=10)
    assert head_client.recv() == "scheduled bad"
    with pytest.raises(RuntimeError, match="relays to nobody"):
        Relay().to_shards("step")
    with pytest.raises(ValueError, match="one actor"):
        Relay().connect(TOKEN, SHARDS, addresses)  # the shards' relay reaches rank 0 only
    with pytest.raises(ChannelClosed, match="refused"):
        ChannelClient(addresses[0], TOKEN, role=b"?")  # no such role


def test_a_relay_reaches_the_draft_and_the_shards_under_one_graph() -> None:
    """The KV-block manager of a graph with a draft relays to both (``relay.py``): a drafting
    step to the draft actor, a step nobody drafts in straight to rank 0. Both routes live under
    one graph's token; connecting under another token (a new graph) drops them all."""
    from keyserve.actors.relay import DRAFT, SHARDS, Relay

    destinations, addresses = _relay_shards(1)
    proposed: list = []
    _, draft = _endpoint(relay_propose=lambda step, batch: proposed.append((step, batch)) or "drafted")
    relay = Relay()
    relay.connect(TOKEN, DRAFT, [draft])
    relay.connect(TOKEN, SHARDS, addresses[:1])
    assert relay.has(DRAFT) and relay.has(SHARDS) and len(relay.clients) == 2
    relay.to_shards("plain step")
    assert gather(destinations, lambda: False, poll_s=10) == [(0, "plain step", None)]
    relay.to_draft("drafting step", "batch")
    for _ in range(100):  # the draft's handler runs on its endpoint's thread
        if proposed:
            break
        time.sleep(0.05)
    assert proposed == [("drafting step", "batch")]
    old = relay.clients
    other_token = b"o" * TOKEN_BYTES  # a new graph: its actors listen under its own token
    other_shard = _new_endpoint().open("127.0.0.1", other_token, {"graph_lead": lambda frame, probs: None})
    relay.connect(other_token, SHARDS, [other_shard])
    assert not relay.has(DRAFT) and all(c.fileno() == -1 for c in old)  # closed sockets
    with pytest.raises(RuntimeError, match="relays to shards, not to the draft"):
        relay.to_draft("step", "batch")


def test_a_relay_that_dies_after_its_send_leaves_no_rank_behind() -> None:
    """The hand-off a relay's death can no longer split (``relay.py``): the relay sends rank 0
    its one message and is gone at once; every rank still runs the step and answers. (When the
    relay sent each rank its own message, the ranks it had not reached yet never got the step,
    and rank 0 waited in a collective for them.)"""
    from keyserve.actors.relay import SHARDS, Relay

    destinations, addresses = _relay_shards(3)
    relay = Relay()
    relay.connect(TOKEN, SHARDS, addresses[:1])
    relay.to_shards("step", "probs")
    relay.clients[0].close()  # the relay's process ends here
    # (a rank that never gets the step fails the gather after 10 s without a reply)
    assert gather(destinations, lambda: False, poll_s=10) == [(0, "step", "probs"), (1, "step", None), (2, "step", None)]


def test_a_relayed_message_cut_off_by_its_senders_death_runs_nowhere() -> None:
    """The other half: a relay that dies while its message to rank 0 is half sent leaves no
    rank with the step (rank 0 drops the connection at the short read and hands nothing on);
    the next relay's step runs everywhere."""
    from keyserve.actors.relay import SHARDS, Relay, lead_message
    from keyserve.actors.step_channel import RELAY

    ran: list = []
    destinations, addresses = _relay_shards(2, ran)
    payload = lead_message("lost step", "probs")
    dying = socket.create_connection(addresses[0])
    dying.sendall(TOKEN + RELAY)
    assert dying.recv(1) == ACCEPTED
    dying.sendall(len(payload).to_bytes(8, "little") + payload[: len(payload) // 2])
    dying.close()
    relay = Relay()  # the graph built again, over the same shards
    relay.connect(TOKEN, SHARDS, addresses[:1])
    relay.to_shards("next step")
    assert gather(destinations, lambda: False, poll_s=10) == [(0, "next step", None), (1, "next step", None)]
    assert sorted(ran) == [(0, "next step"), (1, "next step")]


def test_a_step_item_crosses_a_channel_whole() -> None:
    """``StepItem`` pickles as its constructor's arguments (``step_input.py``): every field,
    none at its default here, comes back (a field left out of the reduction would not)."""
    import copy
    import pickle

    from keyserve.core.kv_policy import KVBudget, KVPolicy
    from keyserve.engine.step_input import StepInput, StepItem

    defaults = StepItem(0, [], 0, [])
    item = StepItem(3, [1, 2], 5, [0, 1], num_lookahead=2, draft_token_ids=[7], draft_row=1,
                    sample_seq_ids=[3, 4], forced_token_id=9, return_logits=1, budget=KVBudget(KVPolicy.H2O, 8),
                    spare=True, num_output_tokens=4, decode_rows=True, prompt_logprob_rows=2, next_prompt_token=6,
                    draft_parents=[0], draft_copied=True, score_split=1)
    assert all(getattr(item, f) != getattr(defaults, f) for f in vars(defaults))
    step = StepInput([item], 1, step=7)
    back = pickle.loads(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == step and back.items[0] == item
    assert copy.deepcopy(item) == item and copy.deepcopy(item).token_ids is not item.token_ids
    _, address = _endpoint(echo=lambda x: x)
    assert _call(ChannelClient(address, TOKEN), "echo", step) == step
