"""An actor's onward connections for a relayed step (``channel_graph.py``): the KV-block manager
hands the step to the draft actor or to the shards, the draft actor to the shards."""

from __future__ import annotations

from collections.abc import Sequence

from keyserve.actors.step_channel import RELAY, ChannelClient, encode

SHARDS, DRAFT = "shards", "draft"


def send_to_shards(clients: Sequence[ChannelClient], method: str, step: object, probs: object = None) -> None:
    """``method(step, probs)`` to rank 0 and ``method(step, None)`` to the other ranks, each
    message encoded once (``probs``: [num_verify, max_draft, vocab], rank 0 only)."""
    others = encode((method, (step, None)))
    first = others if probs is None else encode((method, (step, probs)))
    for i, client in enumerate(clients):
        client.send(first if i == 0 else others)


class Relay:
    """An actor's onward connections for relayed steps: to the draft actor, or to the shards."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.clients: list[ChannelClient] = []

    def connect(self, token: bytes, kind: str, addresses: Sequence[tuple[str, int]]) -> None:
        """(Re)connect to the next hop's actors (a new graph: new actors, a new token)."""
        if kind not in (SHARDS, DRAFT):
            raise ValueError(f"unknown relay target {kind!r}")
        for client in self.clients:
            client.close()
        self.clients, self.kind = [], None
        self.clients = [ChannelClient(tuple(a), token, role=RELAY) for a in addresses]
        self.kind = kind

    def to_draft(self, step: object, batch: object) -> None:
        self._require(DRAFT)
        self.clients[0].send(encode(("relay_propose", (step, batch))))

    def to_shards(self, step: object, probs: object = None) -> None:
        """``probs`` ([num_verify, max_draft, vocab]) to rank 0 only, the step to every rank."""
        self._require(SHARDS)
        send_to_shards(self.clients, "graph_execute", step, probs)

    def _require(self, kind: str) -> None:
        if self.kind != kind:
            raise RuntimeError(f"this actor relays to {self.kind or 'nobody'}, not to the {kind}")
