"""``/metrics`` against what the client saw (found by an oracle sweep of the metrics): an engine
request that fails (here one that outgrows the KV pool while generating) counts in
``request_success_total{finished_reason="error"}`` -- as vLLM's ``FinishReason.ERROR`` -- beside
its tokens in ``prompt_tokens_total`` / ``generation_tokens_total``; before, its tokens counted
and the request itself in no ``finished_reason`` at all."""

from __future__ import annotations

import openai
import pytest
from live_server import LiveServer, live_server


@pytest.fixture(scope="module")
def server(stories_path: str) -> LiveServer:
    # 4 blocks of 16 tokens: a short prompt is admitted, 200 tokens never fit.
    with live_server(model=stories_path, num_blocks=4, block_size=16, seed=0) as live:
        yield live


def _successes(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("keyserve:request_success_total{"))


def test_failed_engine_request_counts_as_error(server: LiveServer) -> None:
    before = server.metrics()
    with pytest.raises(openai.APIStatusError) as info:
        server.client().completions.create(model=None, prompt="once upon a time", max_tokens=200,
                                           extra_body={"ignore_eos": True})
    assert "cannot be scheduled" in str(info.value)
    server.wait_idle()
    after = server.metrics()
    generated = after["keyserve:generation_tokens_total"] - before["keyserve:generation_tokens_total"]
    assert generated > 0  # it ran, and its tokens count ...
    assert _successes(after) - _successes(before) == 1  # ... and so does the request, once
    assert after.get("keyserve:request_success_total{error}", 0) == before.get("keyserve:request_success_total{error}", 0) + 1
    # A failed request has no latency to report.
    e2e = "keyserve:e2e_request_latency_seconds_count"
    assert after.get(e2e, 0) == before.get(e2e, 0)
    status = str(info.value.status_code)
    assert after[f"keyserve:request_rejected_total{{{status}}}"] == before.get(f"keyserve:request_rejected_total{{{status}}}", 0) + 1

    # The server goes on: a request that fits finishes and counts by its reason.
    r = server.client().completions.create(model=None, prompt="once upon a time", max_tokens=5,
                                           extra_body={"ignore_eos": True})
    server.wait_idle()
    final = server.metrics()
    assert r.choices[0].finish_reason == "length"
    assert final["keyserve:request_success_total{length}"] == after.get("keyserve:request_success_total{length}", 0) + 1
    assert final["keyserve:num_requests_running"] == 0
    assert final["keyserve:kv_cache_usage_perc"] == 0
