"""The OpenAI API on a live server (stories260K), driven by the real ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from keyserve import LLM, SamplingParams

from live_server import LiveServer, live_server

PROMPT = "Once upon a time"
LONG_PROMPT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park "
    "with her friends. One day, she saw a big dog"
)


@pytest.fixture(scope="module")
def server(stories_server_options: dict) -> LiveServer:
    with live_server(**stories_server_options) as live:
        yield live


@pytest.fixture(scope="module")
def model(server: LiveServer) -> str:
    return server.serving.model_name


def test_models_and_health(server: LiveServer, model: str) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [model]
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_completion_matches_the_engine(server: LiveServer, model: str, stories_path: str) -> None:
    out = server.client().completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    [choice] = out.choices
    [ref] = LLM(stories_path, num_blocks=64).generate(PROMPT, SamplingParams(max_tokens=24, temperature=0))
    assert choice.text == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == model


def test_several_prompts_n_and_seed(server: LiveServer, model: str) -> None:
    client = server.client()

    def run(seed: int):
        return client.completions.create(model=model, prompt=[PROMPT, "The little dog"], n=3,
                                         max_tokens=12, temperature=1.0, seed=seed)

    first, again, other = run(7), run(7), run(8)
    assert sorted(c.index for c in first.choices) == list(range(6))
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]  # reproducible
    assert texts != [c.text for c in sorted(other.choices, key=lambda c: c.index)]
    assert len(set(texts[:3])) > 1  # the n samples of one prompt differ
    singles = [client.completions.create(model=model, prompt=p, max_tokens=1).usage.prompt_tokens
               for p in (PROMPT, "The little dog")]
    assert first.usage.prompt_tokens == sum(singles)  # each prompt counted once, whatever n
    assert 6 <= first.usage.completion_tokens <= 6 * 12


def test_streaming_equals_non_streaming_and_reports_usage(server: LiveServer, model: str) -> None:
    client = server.client()
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=32, temperature=0, stop=["park"])
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and "park" not in text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_is_sse_ending_in_done(server: LiveServer, model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_logprobs(server: LiveServer, model: str) -> None:
    out = server.client().completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=0)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == out.usage.completion_tokens == len(lp.tokens)
    assert all(x <= 0.0 for x in lp.token_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_streamed_logprobs_are_the_non_streamed_ones(server: LiveServer, model: str) -> None:
    """Every token's logprob in exactly one chunk, with the non-streamed text offsets, also when
    a chunk's text is held back: a long stop string (the text that could start it waits) and
    sampled byte tokens (a character split over tokens shows no text until it is whole)."""
    client = server.client()
    # at T = 100 EOS is one of 512 near-equal tokens: ignore_eos keeps every seed at 40 tokens
    for extra in (dict(temperature=0, stop=["zzzzzzzzzz"]),
                  dict(temperature=100.0, seed=0, extra_body={"ignore_eos": True})):
        kwargs = dict(model=model, prompt=PROMPT, max_tokens=40, logprobs=0, **extra)
        full = client.completions.create(**kwargs).choices[0].logprobs
        tokens, lps, offsets = [], [], []
        for chunk in client.completions.create(**kwargs, stream=True):
            lp = chunk.choices[0].logprobs if chunk.choices else None
            if lp is not None:
                tokens += lp.tokens
                lps += lp.token_logprobs
                offsets += lp.text_offset
        assert len(full.tokens) == 40
        assert (tokens, lps, offsets) == (full.tokens, full.token_logprobs, full.text_offset), extra


def test_keyserve_extensions(server: LiveServer, model: str) -> None:
    client = server.client()
    extra = {"top_k": 5, "min_p": 0.05, "kv_policy": "h2o", "kv_budget": 0.5, "recent_ratio": 0.5,
             "ignore_eos": True}
    out = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=16, extra_body=extra, seed=1)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 16
    greedy = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, extra_body={"top_k": 1})
    assert greedy.choices[0].text == client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text


def test_prefix_cache_hits_are_reported_as_cached_tokens(server: LiveServer, model: str) -> None:
    client = server.client()
    first = client.completions.create(model=model, prompt=LONG_PROMPT + " one", max_tokens=2)
    second = client.completions.create(model=model, prompt=LONG_PROMPT + " two", max_tokens=2)
    assert first.usage.prompt_tokens >= 32
    assert second.usage.prompt_tokens_details.cached_tokens >= 16  # at least one full block
    assert second.usage.prompt_tokens_details.cached_tokens % 16 == 0


def test_metrics_parse_and_count(server: LiveServer, model: str) -> None:
    server.client().completions.create(model=model, prompt=PROMPT, max_tokens=4)
    m = server.metrics()
    for name in ("keyserve:num_requests_running", "keyserve:num_requests_waiting", "keyserve:kv_cache_usage_perc",
                 "keyserve:prefix_cache_queries_total", "keyserve:prefix_cache_hits_total",
                 "keyserve:num_preemptions_total", "keyserve:kv_tokens_evicted_total",
                 "keyserve:spec_decode_num_draft_tokens_total", "keyserve:spec_decode_num_accepted_tokens_total",
                 "keyserve:spec_decode_num_lookup_draft_tokens_total",
                 "keyserve:spec_decode_num_lookup_accepted_tokens_total",
                 "keyserve:time_to_first_token_seconds_count", "keyserve:time_per_output_token_seconds_count",
                 "keyserve:e2e_request_latency_seconds_count"):
        assert name in m, name
    assert 0.0 <= m["keyserve:kv_cache_usage_perc"] <= 1.0
    assert m["keyserve:prefix_cache_hits_total"] <= m["keyserve:prefix_cache_queries_total"]
    assert m["keyserve:time_to_first_token_seconds_count"] >= 1
    assert m["keyserve:request_success_total{length}"] >= 1
    assert m["keyserve:prompt_tokens_total"] > 0 and m["keyserve:generation_tokens_total"] > 0


def test_kv_budget_evictions_are_counted(server: LiveServer, model: str) -> None:
    before = server.metrics()["keyserve:kv_tokens_evicted_total"]
    server.client().completions.create(model=model, prompt=LONG_PROMPT, max_tokens=8,
                                       extra_body={"kv_policy": "window", "kv_budget": 8})
    assert server.metrics()["keyserve:kv_tokens_evicted_total"] > before


def test_disconnect_mid_stream_aborts_and_frees_blocks(server: LiveServer, model: str) -> None:
    server.wait_idle()
    aborted = server.metrics().get("keyserve:request_success_total{abort}", 0.0)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 480, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: ") or line == "" for line in got)
        assert server.engine.stats().num_blocks - server.engine.stats().num_free_blocks > 0
    server.wait_idle(timeout=20)  # the abort freed its KV blocks
    assert server.metrics()["keyserve:request_success_total{abort}"] == aborted + 1


def test_disconnect_while_waiting_for_a_non_streaming_answer_aborts(server: LiveServer, model: str) -> None:
    server.wait_idle()
    aborted = server.metrics().get("keyserve:request_success_total{abort}", 0.0)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 480, "n": 8, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    server.wait_idle(timeout=20)
    assert server.metrics()["keyserve:request_success_total{abort}"] == aborted + 1


def test_64_concurrent_streams_all_complete(server: LiveServer, model: str) -> None:
    server.wait_idle()
    steps_before = server.engine.stats().num_steps
    max_tokens = 24

    async def one(client, i: int) -> tuple[str, str, int]:
        stream = await client.completions.create(
            model=model, prompt=f"{PROMPT} {i}", max_tokens=max_tokens, temperature=0.8, seed=i,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        return text, finish, usage.completion_tokens

    async def main():
        async with server.async_client(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    t = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t
    assert len(results) == 64
    assert all(finish == "length" and n == max_tokens and text for text, finish, n in results)
    steps = server.engine.stats().num_steps - steps_before
    assert steps < 64 * max_tokens / 4, f"{steps} steps: the requests were not batched"
    server.wait_idle()
    print(f"64 concurrent streams: {elapsed:.2f} s, {steps} engine steps")
