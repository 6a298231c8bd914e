"""Transient failures in a batch job (stories260K, the real engine): retried with backoff, and
when they outlast the retries left without a record, so that a rerun runs them.

The queue-full 503s, the 408 timeouts and the engine's death are real; only the step failure
(500) is injected, since the engine now keeps a bad request from failing its step.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from keyserve.cluster.batch_job import main as batch_main
from keyserve.cluster.batch_job import run_batch
from keyserve.cluster.batch_retry import RetryPolicy
from keyserve.cluster.openai_serving import OpenAIServing
from keyserve.config import ServeConfig
from keyserve.engine.async_engine import EngineStepError

FAST = RetryPolicy(max_attempts=60, backoff_s=0.005, max_backoff_s=0.05)
# Lines that wait for a seat retry until one frees, however slow a loaded machine makes the
# requests ahead of them (60 short waits ran out once at load 4, with 6 lines still waiting).
PATIENT = RetryPolicy(max_attempts=2000, backoff_s=0.005, max_backoff_s=0.05)


def completion(cid: str, prompt: str, max_tokens: int = 6) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}})


def write_input(path: Path, n: int, max_tokens: int = 6) -> set[str]:
    lines = [completion(f"t{i:02d}", f"The little bird {i}", max_tokens) for i in range(n)]
    lines.append(completion("bad", "x")[:-2] + ', "top_p": 3}}')  # permanent: 400
    path.write_text("\n".join(lines) + "\n")
    return {f"t{i:02d}" for i in range(n)} | {"bad"}


def records(path: Path) -> dict[str, dict]:
    rs = [json.loads(line) for line in path.read_text().splitlines()]
    counts = Counter(r["custom_id"] for r in rs)
    assert all(n == 1 for n in counts.values()), counts.most_common(3)
    return {r["custom_id"]: r for r in rs}


def texts(recs: dict[str, dict]) -> dict[str, list[str]]:
    return {cid: [c["text"] for c in r["response"]["body"]["choices"]]
            for cid, r in recs.items() if r["response"] and r["response"]["status_code"] == 200}


def serving(model: str, **options: Any) -> OpenAIServing:
    return OpenAIServing.from_config(ServeConfig(model=model, num_blocks=256, **options))


async def run(srv: OpenAIServing, src: Path, out: Path, concurrency: int, policy: RetryPolicy):
    try:
        await srv.engine.wait_ready()
        return await run_batch(srv, src, out, concurrency, progress=False, policy=policy)
    finally:
        srv.engine.shutdown()


@pytest.fixture(scope="module")
def reference(stories_path: str, tmp_path_factory) -> dict[str, list[str]]:
    """What an undisturbed run answers (greedy)."""
    tmp = tmp_path_factory.mktemp("ref")
    write_input(tmp / "in.jsonl", 16)
    srv = serving(stories_path)
    summary = asyncio.run(run(srv, tmp / "in.jsonl", tmp / "out.jsonl", 8, FAST))
    assert summary.retries == 0 and summary.succeeded == 16
    return texts(records(tmp / "out.jsonl"))


def test_queue_full_is_retried_until_every_line_runs(stories_path: str, tmp_path: Path,
                                                      reference: dict[str, list[str]]) -> None:
    """Eight lines in flight against room for two: the rest get the engine's real 503
    (server_overloaded), back off and come back, until all have run."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    expected = write_input(src, 16)
    srv = serving(stories_path, max_num_seqs=2, max_queued_requests=0)
    summary = asyncio.run(run(srv, src, out, 8, PATIENT))
    assert summary.retries > 0, summary
    assert summary.unfinished == 0 and summary.succeeded == 16 and summary.failed == 1
    recs = records(out)
    assert set(recs) == expected
    assert texts(recs) == reference
    assert recs["bad"]["response"]["status_code"] == 400


class FlakySteps:
    """The real serving, but the first ``fail_first`` attempts of each line raise the engine's
    step failure (500 engine_step_failed); counts the attempts per prompt."""

    def __init__(self, real: OpenAIServing, fail_first: int) -> None:
        self.real, self.engine, self.fail_first = real, real.engine, fail_first
        self.attempts: Counter[str] = Counter()

    async def handle(self, kind: str, body: Any) -> Any:
        prompt = str(body.get("prompt"))
        self.attempts[prompt] += 1
        if self.attempts[prompt] <= self.fail_first:
            from keyserve.cluster.errors import to_api_error

            raise to_api_error(EngineStepError("engine step failed: injected"))
        return await self.real.handle(kind, body)


def test_a_failed_step_is_retried_and_a_bad_body_is_not(stories_path: str, tmp_path: Path,
                                                         reference: dict[str, list[str]]) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    expected = write_input(src, 16)
    flaky = FlakySteps(serving(stories_path), fail_first=2)
    summary = asyncio.run(run(flaky, src, out, 8, FAST))  # type: ignore[arg-type]
    assert summary.unfinished == 0 and summary.retries == 2 * 17
    recs = records(out)
    assert set(recs) == expected and texts(recs) == reference
    assert flaky.attempts["x"] == 3  # the bad line: two injected 500s, then its 400, once
    assert recs["bad"]["response"]["status_code"] == 400


def test_failures_that_outlast_the_retries_are_left_for_a_rerun(stories_path: str, tmp_path: Path,
                                                                 capsys) -> None:
    """Every request times out (408, a real timeout of the engine): no line gets a record but
    the bad one, the job exits 3; the rerun without the limit completes every line once."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    expected = write_input(src, 6, max_tokens=24)
    flags = ["--input", str(src), "--output", str(out), "--model", stories_path, "--num-blocks", "256",
             "--no-progress", "--max-attempts", "2", "--retry-backoff-s", "0.01"]
    assert batch_main([*flags, "--timeout-s", "0.000001"]) == 3
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["unfinished"] == 6 and summary["retries"] == 6 and summary["failed"] == 1
    assert "408 request_timeout" in captured.err and "left for a rerun" in captured.err
    assert set(records(out)) == {"bad"}

    assert batch_main(flags) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["skipped"] == 1 and summary["succeeded"] == 6 and summary["unfinished"] == 0
    assert set(records(out)) == expected


class DiesAfter:
    """The real serving; when the ``n``-th request arrives the engine is shut down for real
    (as if its thread died): it and every later request fail with the engine's 503."""

    def __init__(self, real: OpenAIServing, n: int) -> None:
        self.real, self.engine, self.n, self.seen = real, real.engine, n, 0

    async def handle(self, kind: str, body: Any) -> Any:
        self.seen += 1
        if self.seen == self.n:
            self.engine.shutdown()
        return await self.real.handle(kind, body)


def test_a_dead_engine_stops_the_job_without_recording_its_503s(stories_path: str, tmp_path: Path,
                                                                 reference: dict[str, list[str]]) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    expected = write_input(src, 16)
    dying = DiesAfter(serving(stories_path), 6)
    summary = asyncio.run(run(dying, src, out, 2, FAST))  # type: ignore[arg-type]
    assert summary.unfinished > 0 and summary.retries == 0
    assert summary.succeeded + summary.failed + summary.unfinished == 17
    assert dying.seen < 6 + 2 + 1  # it stopped taking lines instead of failing them all
    recs = records(out)
    assert all(r["response"]["status_code"] in (200, 400) for r in recs.values())
    assert len(recs) == summary.succeeded + summary.failed

    summary = asyncio.run(run(serving(stories_path), src, out, 4, FAST))  # the rerun
    assert summary.unfinished == 0
    recs = records(out)
    assert set(recs) == expected and texts(recs) == reference


class CancelledInside:
    """A serving whose request awaits a future that the server cancels (as the engine's
    shutdown cancels its tokenizer futures)."""

    engine = type("Engine", (), {"is_alive": True})()

    async def handle(self, kind: str, body: Any) -> Any:
        inner = asyncio.get_running_loop().create_future()
        inner.cancel()
        return await inner


def test_a_future_cancelled_inside_the_server_is_transient_but_cancelling_the_job_is_not() -> None:
    from keyserve.cluster.batch_io import InputLine
    from keyserve.cluster.batch_job import process_line
    from keyserve.cluster.batch_retry import is_transient

    line = InputLine(1, completion("c", "x"), "c")
    record = asyncio.run(process_line(CancelledInside(), line))
    assert record["response"]["status_code"] == 503 and is_transient(record)

    async def cancel_the_job() -> None:
        class Waits:
            engine = CancelledInside.engine

            async def handle(self, kind: str, body: Any) -> Any:
                await asyncio.sleep(3600)

        task = asyncio.create_task(process_line(Waits(), line))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_the_job())
