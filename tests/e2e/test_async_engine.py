"""AsyncLLMEngine over the real engine (stories260K): streaming, batching across callers,
abort, bounded queue, timeouts, bad input, stalls and death — the contract the HTTP layer and
the batch job rely on."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from keyserve.config import EngineConfig
from keyserve.core.sampling_params import SamplingParams
from keyserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
    RequestTimeoutError,
)
from keyserve.engine.llm_engine import PromptTooLongError

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(stories_path: str):
    eng = AsyncLLMEngine(EngineConfig.from_flat(model=stories_path, num_blocks=128, max_num_seqs=8),
                         max_queued_requests=4)
    assert eng.wait_ready_blocking(300)
    yield eng
    eng.shutdown()


def idle(engine: AsyncLLMEngine) -> bool:
    st = engine.stats()
    return st.num_free_blocks == st.num_blocks and not st.num_requests_running and not st.num_requests_waiting


async def settle(engine: AsyncLLMEngine) -> None:
    for _ in range(200):
        if idle(engine):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(engine.stats())


def test_streams_snapshots_until_finished(engine: AsyncLLMEngine) -> None:
    async def main():
        return [out async for out in engine.generate("Once upon a time", GREEDY)]

    outs = asyncio.run(main())
    lengths = [len(o.token_ids) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] == 16
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == "length" and outs[-1].text.startswith(outs[-2].text[:1])
    assert idle(engine)


def test_final_only_streams_the_finished_snapshot_alone(engine: AsyncLLMEngine) -> None:
    """A non-streaming consumer (``final_only``) gets one snapshot, the finished one, equal to
    the last of a streamed run of the same request; the streamed run beside it still gets one
    per step, and a final-only request aborted midway still ends its stream."""

    async def run(final_only: bool, params: SamplingParams = GREEDY):
        stream = await engine.add_request("Once upon a time", params, final_only=final_only)
        return [out async for out in stream]

    async def main():
        return await asyncio.gather(run(True), run(False))

    final, streamed = asyncio.run(main())
    assert len(streamed) > 1
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == streamed[-1].outputs[0].token_ids
    assert final[0].text == streamed[-1].text

    async def aborted():
        stream = await engine.add_request("Once upon a time", LONG, final_only=True)
        await asyncio.sleep(0.05)
        await engine.abort(stream.request_id)
        return [out async for out in stream]

    outs = asyncio.run(aborted())
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "abort"
    asyncio.run(settle(engine))
    assert not engine._final_only


def test_concurrent_callers_share_steps(engine: AsyncLLMEngine) -> None:
    before = engine.stats().num_steps

    async def one(i: int) -> str:
        async for out in engine.generate(f"Once upon a time {i}", GREEDY):
            pass
        return out.text

    async def main():
        return await asyncio.gather(*(one(i) for i in range(8)))

    texts = asyncio.run(main())
    assert len(texts) == 8 and all(texts)
    assert engine.stats().num_steps - before < 8 * 16 / 2  # one step serves the whole batch


def test_abort_and_early_exit_free_blocks(engine: AsyncLLMEngine) -> None:
    async def main():
        stream = await engine.add_request("Once upon a time", LONG)
        outs = []
        async for out in stream:
            outs.append(out)
            if len(outs) == 3:
                await engine.abort(stream.request_id)
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        await settle(engine)
        async for _ in engine.generate("Once upon a time", LONG):
            break  # leaving the loop aborts the request
        await settle(engine)
        stream = await engine.add_request("Once upon a time", LONG)
        await stream.aclose()  # never read: closing aborts it too
        await settle(engine)

    asyncio.run(main())


def test_bounded_queue(engine: AsyncLLMEngine) -> None:
    async def main():
        streams = [await engine.add_request("Once upon a time", LONG) for _ in range(8 + 4)]
        with pytest.raises(QueueFullError):
            await engine.add_request("Once upon a time", LONG)
        for s in streams:
            await s.aclose()
        await settle(engine)
        async for out in engine.generate("Once upon a time", GREEDY):  # room again
            pass
        assert out.finished

    asyncio.run(main())


def test_timeout_aborts(engine: AsyncLLMEngine) -> None:
    async def main():
        with pytest.raises(RequestTimeoutError):
            async for _ in engine.generate("Once upon a time", SamplingParams(max_tokens=400, n=8, ignore_eos=True),
                                           timeout_s=0.3):
                pass
        await settle(engine)

    asyncio.run(main())


def test_bad_input_leaves_nothing_behind(engine: AsyncLLMEngine) -> None:
    async def main():
        with pytest.raises(PromptTooLongError, match="600 tokens.*512"):
            await engine.add_request([5] * 600, GREEDY)
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("", GREEDY)  # whitespace is a prompt (it has tokens)
        with pytest.raises(ValueError, match="chat template"):
            await engine.add_request(messages=[{"role": "user", "content": "hi"}], params=GREEDY)
        with pytest.raises(ValueError, match="draft"):
            await engine.add_request("Once", SamplingParams(speculative=True))
        # Not token ids: bytes would be their byte values, a dict its keys.
        with pytest.raises(ValueError, match="bytes"):
            await engine.add_request(b"Once", GREEDY)
        with pytest.raises(ValueError, match="dict"):
            await engine.add_request({"prompt_token_ids": [1, 2]}, GREEDY)
        with pytest.raises(ValueError, match=r"integers in \[0, 512\)"):
            await engine.add_request(prompt_token_ids=[1, "2"], params=GREEDY)
        assert idle(engine) and not engine.engine.requests
        ids = list(engine.tokenizer.encode("Once upon a time"))  # numpy ints are token ids
        want = [out async for out in engine.generate(prompt_token_ids=ids, params=GREEDY)][-1]
        got = [out async for out in engine.generate(prompt_token_ids=np.array(ids), params=GREEDY)][-1]
        assert got.token_ids == want.token_ids and got.prompt_token_ids == ids

    asyncio.run(main())


def test_generation_that_outgrows_the_pool_fails_instead_of_hanging(stories_path: str) -> None:
    small = AsyncLLMEngine(EngineConfig.from_flat(model=stories_path, num_blocks=4))

    async def main():
        await small.wait_ready()
        with pytest.raises(ValueError, match="needs 7 KV blocks"):  # refused up front
            await small.add_request([5] * 100, GREEDY)
        with pytest.raises(ValueError, match="cannot be scheduled"):  # found out while running
            async for _ in small.generate("Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True),
                                          timeout_s=60):
                pass

    try:
        asyncio.run(main())
        assert idle(small)
    finally:
        small.shutdown()


def test_shutdown_and_failed_load_report_dead(tmp_path) -> None:
    broken = AsyncLLMEngine(EngineConfig.from_flat(model=str(tmp_path / "nowhere")))
    with pytest.raises(EngineDeadError):
        broken.wait_ready_blocking(120)
    assert not broken.is_alive and not broken.is_ready

    async def main():
        with pytest.raises(EngineDeadError):
            await broken.add_request("Once", GREEDY)

    asyncio.run(main())
