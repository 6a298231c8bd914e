"""An actor's onward connections for a relayed step (``channel_graph.py``): the KV-block manager
hands the step to the draft actor or to the shards, the draft actor to the shards, and rank 0
of the shards to the other ranks.

Why rank 0 hands the step on, not the relay: a relay that died between its sends (rank 0 got
the step, rank 1 not) left rank 0 in a collective its peers never joined. Rank 0's compute
thread then could not take the next graph's connections, and the engine's recovery timed out
(seen in tests/ray/test_faults.py at TP = 2). With one message per step to rank 0, which sends
the step on before it runs it, every rank gets the step or none does: a message cut off by its
sender's death is never handled (``step_channel._recv`` raises at the short read), and rank 0
dying is a lost shard, which replaces the whole group anyway. The cost is one local socket hop
before rank 1 starts (tens of microseconds); rank 0 forwards the bytes it got, undecoded.
"""

from __future__ import annotations

from collections.abc import Sequence

from keyserve.actors.step_channel import RELAY, ChannelClient, decode, encode

SHARDS, DRAFT, PEERS = "shards", "draft", "peers"


def send_to_shards(clients: Sequence[ChannelClient], method: str, step: object, probs: object = None) -> None:
    """``method(step, probs)`` to rank 0 and ``method(step, None)`` to the other ranks, each
    message encoded once (``probs``: [num_verify, max_draft, vocab], rank 0 only). The driver's
    own calls: the driver cannot die between two sends and leave the engine running."""
    others = encode((method, (step, None)))
    first = others if probs is None else encode((method, (step, probs)))
    for i, client in enumerate(clients):
        client.send(first if i == 0 else others)


def lead_message(step: object, probs: object = None) -> bytes:
    """The relayed step as rank 0 gets it: ``graph_lead(frame, probs)``, where ``frame`` is the
    other ranks' ``graph_execute(step, None)``, encoded once (``probs``: [num_verify, max_draft,
    vocab], rank 0 only)."""
    frame = encode(("graph_execute", (step, None)))
    return encode(("graph_lead", (frame, probs)))


def hand_on(peers: Relay, frame: bytes) -> object:
    """Rank 0's part of ``graph_lead``: ``frame`` to every other rank, then the step it carries
    (for rank 0 to run)."""
    peers.to_peers(frame)
    _, (step, _) = decode(frame)
    return step


class Relay:
    """An actor's onward connections for relayed steps: to the draft actor and/or to rank 0 of
    the shards (the KV-block manager of a graph with a draft has both: a step nobody drafts in
    goes straight to the shards), or (rank 0's) to the other ranks. One graph's connections
    share its token; connecting under a new token (a new graph) drops the old graph's."""

    def __init__(self) -> None:
        self.token: bytes | None = None
        self.routes: dict[str, list[ChannelClient]] = {}

    @property
    def clients(self) -> list[ChannelClient]:
        return [client for clients in self.routes.values() for client in clients]

    def has(self, kind: str) -> bool:
        return kind in self.routes

    def connect(self, token: bytes, kind: str, addresses: Sequence[tuple[str, int]]) -> None:
        """(Re)connect to the next hop's actors of ``kind`` (a new token: a new graph, new actors)."""
        if kind not in (SHARDS, DRAFT, PEERS):
            raise ValueError(f"unknown relay target {kind!r}")
        if kind != PEERS and len(addresses) != 1:
            raise ValueError(f"a relay to the {kind} connects to one actor (rank 0 for the shards), "
                             f"not {len(addresses)}")
        stale = self.clients if token != self.token else self.routes.pop(kind, [])
        if token != self.token:
            self.routes, self.token = {}, token
        for client in stale:
            client.close()
        self.routes[kind] = [ChannelClient(tuple(a), token, role=RELAY) for a in addresses]

    def to_draft(self, step: object, batch: object) -> None:
        self._route(DRAFT)[0].send(encode(("relay_propose", (step, batch))))

    def to_shards(self, step: object, probs: object = None) -> None:
        """The step to rank 0, which hands it on to the other ranks (``probs``: [num_verify,
        max_draft, vocab], for rank 0 only)."""
        self._route(SHARDS)[0].send(lead_message(step, probs))

    def to_peers(self, frame: bytes) -> None:
        """Rank 0: the other ranks' message, as it came."""
        for client in self._route(PEERS):
            client.send(frame)

    def _route(self, kind: str) -> list[ChannelClient]:
        if kind not in self.routes:
            raise RuntimeError(f"this actor relays to {' and '.join(self.routes) or 'nobody'}, not to the {kind}")
        return self.routes[kind]
