"""One engine step relayed actor to actor over the step channels: the compiled graph's shape
(``step_graph.py``) on sockets, where nobody busy-waits.

    driver --request, draft batch--> KV-block manager (commands, schedule)
      --step, draft batch--> draft actor (drafts into the step)
      --step, draft probs--> target shard rank 0 --step--> the other ranks
      (forward, rank 0 samples and verifies) --output--> driver

A step in which no sequence drafts (adaptive K chose K = 0 for all, prompts, requests without
speculation) carries no draft batch and goes from the KV-block manager straight to rank 0, as
in a graph without a draft: such a step costs what plain decoding does.

Rank 0 hands the step to the other ranks itself (``relay.py`` says why: a relay that died
between two sends left rank 0 alone in a collective).

Each actor hands the step on before it answers the driver with what only it knows: the
KV-block manager its answer (block counts, core stats) and the step, the draft actor its draft
tokens and the step as the shards run it. So the step's critical path is three socket hops
(driver -> KV-block manager -> shards -> driver) where the driver-mediated channel path takes
four, and the driver reads the KV-block manager's answer while the shards compute. The
messages and handlers are the compiled graph's (``graph_step``, ``graph_propose``,
``graph_execute``), so both graphs run the same step and return the same ``GraphResult``.

The replies of relayed messages travel on the engine's *destination* connection to each actor
(``step_channel.DESTINATION``); the relay connections (``step_channel.RELAY``) carry requests
only. A lost actor closes its sockets: the driver's read sees it at once and the engine
diagnoses and replaces the actor as for the compiled graph; the graph is then built again over
the new actors (a few Ray calls).
"""

from __future__ import annotations

import ray

from keyserve.actors.common import alive, channel_addresses
from keyserve.actors.relay import DRAFT, PEERS, SHARDS
from keyserve.actors.step_channel import DESTINATION, ChannelClient, encode, gather
from keyserve.actors.step_graph import GraphResult, graph_key


class ChannelGraph:
    """The relayed step over one set of actors (``key`` names them, as ``StepGraph``'s)."""

    def __init__(self, core: object, workers: list, draft: object | None, poll_s: float = 10.0) -> None:
        self.key = graph_key(core, workers, draft)
        self.has_draft = draft is not None
        self.poll_s = poll_s
        self._drafting = False  # the submitted step goes by the draft actor
        self.actors = [core, *([draft] if draft is not None else []), *workers]
        token, addresses = channel_addresses(self.actors)
        self.clients: list[ChannelClient] = []
        try:
            for address in addresses:
                self.clients.append(ChannelClient(address, token, role=DESTINATION))
            shards = addresses[-len(workers):]
            head = draft if draft is not None else core  # who hands the step to rank 0
            calls = [workers[0].relay_to.remote(token, PEERS, shards[1:]),
                     head.relay_to.remote(token, SHARDS, shards[:1])]  # type: ignore[attr-defined]
            if draft is not None:  # the core reaches both: a step nobody drafts in skips the draft actor
                calls.append(core.relay_to.remote(token, DRAFT, [addresses[1]]))  # type: ignore[attr-defined]
                calls.append(core.relay_to.remote(token, SHARDS, shards[:1]))  # type: ignore[attr-defined]
            ray.get(calls)
        except BaseException:
            self.teardown()  # an actor lost while connecting: the step that asked diagnoses it
            raise

    def run(self, request: object, batch: object | None) -> GraphResult:
        self.submit(request, batch)
        return self.read()

    def submit(self, request: object, batch: object | None) -> None:
        """Send one step's request to the KV-block manager (the engine may read it later).
        Without a draft batch the step skips the draft actor: the KV-block manager hands it to
        the shards itself, one socket hop and one decode of the step fewer."""
        self._drafting = self.has_draft and batch is not None
        self.clients[0].send(encode(("relay_step", (request, batch))))

    def read(self) -> GraphResult:
        """Every actor's reply to the submitted step (the first failure raises: a closed
        channel, or an actor's own error); the draft actor's only if the step went by it."""
        skipped = self.has_draft and not self._drafting
        clients = [self.clients[0], *self.clients[2:]] if skipped else self.clients
        replies = gather(clients, lambda: alive(self.actors), self.poll_s)
        step, answer = replies[0]
        drafts = None
        if self._drafting:
            step, drafts = replies[1]
        return GraphResult(step, answer, drafts, replies[1 + self._drafting])

    def teardown(self) -> None:
        for client in self.clients:
            client.close()
        self.clients = []
