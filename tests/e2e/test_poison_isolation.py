"""Poison requests among 32 concurrent streams, through the live HTTP server with the real
``openai`` client (stories260K, greedy): every good stream gets exactly the text it gets alone,
each poison gets its own clear error, and the server stays healthy. Also a batch job with
poison lines in the middle: an error record for those lines only.

Poisons come in three kinds: values refused before the engine (400: out of any range, or out
of this model's -- a stop token outside the vocabulary, a budget past the context; a ``top_k``
far past the vocabulary is clamped and served as usual), and
values injected past both (``admit_params`` swapped for a test hook that hands the engine raw
``model_construct`` parameters, as a forgotten check would): those overflow inside the step,
before the first token (a 400 status) or mid-stream (an error event in the stream).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from live_server import LiveServer, live_server

import keyserve.engine.llm_engine as llm_engine
from keyserve.cluster.batch_job import main as batch_main
from keyserve.core.sampling_params import SamplingParams
from helpers.poison import RaisesAfter

NUM_GOOD = 32
MODEL = "stories260k"
WORDS = "once upon a time there was a little girl named lily who loved to play outside in the park".split()


# seed -> what the hook puts in place of the checked parameters (fresh per request)
PAST_ADMISSION = {
    910001: lambda: {"top_k": 2**70, "temperature": 1.0},  # overflows the sampler's tensors
    910002: lambda: {"kv_policy": "h2o", "kv_budget": 1e18},  # overflows the KV-budget state
    910003: lambda: {"stop_token_ids": None},  # breaks the stop checks at the first token
    910004: lambda: {"stop_token_ids": RaisesAfter(6)},  # ... after six tokens
}


@pytest.fixture(scope="module")
def poison_hook() -> Iterator[None]:
    """Requests carrying a marker seed reach the engine with raw, unchecked parameters."""
    real = llm_engine.admit_params

    def admit(params, limits):
        poison = PAST_ADMISSION.get(getattr(params, "seed", None))
        if poison is None:
            return real(params, limits)
        return SamplingParams.model_construct(**{**params.model_dump(), "seed": None, **poison()})

    mp = pytest.MonkeyPatch()
    mp.setattr(llm_engine, "admit_params", admit)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def server(stories_path: str, poison_hook) -> Iterator[LiveServer]:
    with live_server(model=stories_path, served_model_name=MODEL, num_blocks=1024, seed=0, max_num_seqs=64) as live:
        yield live


def prompt(i: int) -> str:
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + i % 9))


def good_body(i: int) -> dict:
    body = {"max_tokens": 12 + i % 9, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    if i % 8 == 5:  # far past the vocabulary: clamped to it (it used to overflow the sampler)
        body["extra_body"]["top_k"] = 10**12
    if i % 8 == 6:  # a budget that holds the whole context: evicts nothing, as if there were none
        body["extra_body"].update(kv_policy="h2o", kv_budget=512)
    return body


async def stream_text(client: openai.AsyncOpenAI, text: str, **body) -> tuple[str, str | None]:
    """The streamed text and finish reason of one completion."""
    stream = await client.completions.create(model=MODEL, prompt=text, stream=True, **body)
    out, finish = [], None
    async for chunk in stream:
        for choice in chunk.choices:
            out.append(choice.text)
            finish = choice.finish_reason or finish
    return "".join(out), finish


def test_poison_requests_fail_alone_among_32_streams(server: LiveServer) -> None:
    client = server.async_client()

    async def solo_texts() -> list[str]:  # one at a time, no top_k, no budget
        return [(await stream_text(client, prompt(i), max_tokens=good_body(i)["max_tokens"], temperature=0.0,
                                   extra_body={"ignore_eos": True}))[0] for i in range(NUM_GOOD)]

    async def expect_400(param: str, **body) -> str:
        with pytest.raises(openai.BadRequestError) as info:
            await stream_text(client, "Once upon a time", max_tokens=16, **body)
        error = info.value.body
        assert error["param"] == param, error
        return error["message"]

    async def broken_mid_stream() -> tuple[str, str]:
        stream = await client.completions.create(model=MODEL, prompt="Once upon a time", stream=True,
                                                 max_tokens=40, temperature=0.0, seed=910004,
                                                 extra_body={"ignore_eos": True})
        got = []
        with pytest.raises(openai.APIError) as info:
            async for chunk in stream:
                got.append(chunk.choices[0].text)
        return "".join(got), str(info.value)

    async def past_admission(seed: int) -> str:
        with pytest.raises(openai.BadRequestError) as info:
            await stream_text(client, "Once upon a time", max_tokens=16, seed=seed)
        return info.value.body["message"]

    async def main():
        alone = await solo_texts()
        server.wait_idle()
        goods = [stream_text(client, prompt(i), **good_body(i)) for i in range(NUM_GOOD)]
        poisons = [
            expect_400("temperature", temperature=-1.0),
            expect_400("top_p", top_p=3),
            expect_400("stop_token_ids", extra_body={"stop_token_ids": [10**6]}),
            expect_400("kv_budget", extra_body={"kv_policy": "h2o", "kv_budget": 1e9}),
            past_admission(910001), past_admission(910002), past_admission(910003),
            broken_mid_stream(),
        ]
        results = await asyncio.gather(*goods, *poisons)
        return alone, results[:NUM_GOOD], results[NUM_GOOD:]

    alone, goods, poisons = asyncio.run(main())
    for i, ((text, finish), expected) in enumerate(zip(goods, alone)):
        assert finish == "length" and text == expected, (i, good_body(i))
    assert "512" in poisons[2] and "512" in poisons[3]  # the vocabulary; the context
    assert "sampling failed" in poisons[4] and "KV budget failed" in poisons[5]
    assert "stop checks" in poisons[6]
    partial, error = poisons[7]
    assert partial and "stop checks" in error  # some text, then the error event
    r = httpx.get(server.url + "/health", timeout=30)
    assert r.status_code == 200, r.text
    server.wait_idle()
    assert server.engine.is_alive
    again = asyncio.run(stream_text(server.async_client(), prompt(0), **good_body(0)))
    assert again == (alone[0], "length")


def completion_line(cid: str, text: str, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": text, "max_tokens": 10, "temperature": 0, "ignore_eos": True, **body}})


def test_batch_job_poison_lines_fail_alone(tmp_path: Path, stories_path: str, poison_hook) -> None:
    """Poison lines between good ones (run concurrently, so they share the engine's steps):
    an error record for each poison line, the good lines' answers as when run alone."""
    flags = ["--model", stories_path, "--num-blocks", "512", "--no-progress", "--concurrency", "16"]
    good = [completion_line(f"ok-{i}", prompt(i)) for i in range(12)]
    poison = [completion_line("bad-edge", "x", top_p=3),
              completion_line("bad-sampler", "Once upon a time", seed=910001),
              completion_line("bad-budget", "Once upon a time", seed=910002),
              completion_line("bad-stop", "Once upon a time", seed=910004, max_tokens=30)]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    alone_src, alone_out = tmp_path / "alone.jsonl", tmp_path / "alone_out.jsonl"
    src.write_text("\n".join(good[:6] + poison + good[6:]) + "\n")
    alone_src.write_text("\n".join(good) + "\n")
    assert batch_main(["--input", str(alone_src), "--output", str(alone_out), *flags, "--concurrency", "1"]) == 0
    assert batch_main(["--input", str(src), "--output", str(out), *flags]) == 0
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    alone = {r["custom_id"]: r for r in map(json.loads, alone_out.read_text().splitlines())}
    assert len(records) == len(good) + len(poison)
    for cid, rec in alone.items():
        assert records[cid]["response"]["status_code"] == 200 and records[cid]["error"] is None
        assert records[cid]["response"]["body"]["choices"] == rec["response"]["body"]["choices"], cid
    for cid, stage in (("bad-edge", None), ("bad-sampler", "sampling failed"),
                       ("bad-budget", "KV budget failed"), ("bad-stop", "stop checks")):
        response = records[cid]["response"]
        assert response["status_code"] == 400, (cid, response)
        assert stage is None or stage in response["body"]["error"]["message"], (cid, response)


def test_async_engine_fails_only_the_step_a_fault_hits(stories_path: str) -> None:
    """A fault in the forward itself (injected: no request can cause one) fails the two
    requests of that step with ``EngineStepError``; the request waiting for a seat meanwhile
    gets its solo output, and the engine stays alive."""
    from keyserve.config import EngineConfig
    from keyserve.engine.async_engine import AsyncLLMEngine, EngineStepError

    engine = AsyncLLMEngine(EngineConfig.from_flat(model=stories_path, num_blocks=128, max_num_seqs=2))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def break_next_forward() -> None:
        runner = engine.engine.runner
        real = runner.forward_logits

        def broken(*args, **kwargs):
            runner.forward_logits = real
            raise RuntimeError("device fault")

        runner.forward_logits = broken

    async def run(text: str) -> list[int]:
        async for out in engine.generate(text, params):
            pass
        return out.token_ids

    async def main():
        await engine.wait_ready(300)
        alone = await run(prompt(3))
        streams = [await engine.add_request(prompt(i), params) for i in range(2)]
        waiting = asyncio.ensure_future(run(prompt(3)))
        await engine._call(break_next_forward)  # runs between two steps, on the engine thread
        for stream in streams:
            with pytest.raises(EngineStepError, match="device fault"):
                async for _ in stream:
                    pass
        assert await waiting == alone

    try:
        asyncio.run(main())
        assert engine.is_alive
    finally:
        engine.shutdown()
