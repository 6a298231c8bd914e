"""Speculative sampling and a tight KV pool through the server: stories260K drafting for itself
(same vocabulary, so every draft is accepted), 24 KV blocks so concurrent requests preempt."""

from __future__ import annotations

import asyncio

import pytest
from live_server import LiveServer, live_server

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server(stories_path: str) -> LiveServer:
    with live_server(model=stories_path, draft=stories_path, num_speculative_tokens=3,
                     num_blocks=24, seed=0) as live:
        yield live


def test_speculative_tokens_are_counted_and_greedy_output_is_unchanged(server: LiveServer) -> None:
    client = server.client()
    model = server.serving.model_name
    before = server.metrics()
    spec = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"num_speculative_tokens": 2})
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                      extra_body={"speculative": False})
    assert spec.choices[0].text == plain.choices[0].text
    after = server.metrics()
    drafted = after["keyserve:spec_decode_num_draft_tokens_total"] - before["keyserve:spec_decode_num_draft_tokens_total"]
    accepted = (after["keyserve:spec_decode_num_accepted_tokens_total"]
                - before["keyserve:spec_decode_num_accepted_tokens_total"])
    assert drafted > 0 and accepted == drafted  # the draft is the target


def test_preemptions_are_counted_and_every_request_completes(server: LiveServer) -> None:
    server.wait_idle()
    before = server.metrics()["keyserve:num_preemptions_total"]

    async def main():
        async with server.async_client(timeout=120) as client:
            return await asyncio.gather(*(
                client.completions.create(model=server.serving.model_name, prompt=f"{PROMPT} {i}", max_tokens=100,
                                          temperature=0, extra_body={"ignore_eos": True, "speculative": False})
                for i in range(6)))

    outs = asyncio.run(main())  # 6 x 7 blocks > 24: some are preempted and recomputed
    assert all(o.usage.completion_tokens == 100 for o in outs)
    assert server.metrics()["keyserve:num_preemptions_total"] > before
    server.wait_idle()
