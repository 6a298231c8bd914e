"""Serving overhead: the same streaming workload on the engine directly and through HTTP.

For 1, 8 and 32 concurrent closed-loop clients: time to first token and time per output token
(p50 / p99) and request throughput, measured
- ``engine``: ``AsyncLLMEngine.generate`` in this process (no HTTP);
- ``serve``: ``keyserve serve`` (Ray Serve: proxy -> replica) in a subprocess, streaming
  ``/v1/completions`` over loopback;
- ``http`` (optional): ``keyserve serve --no-ray`` (uvicorn, no Ray) in a subprocess.
Prompts are token ids cut from real text (bench/workloads.py), every request decodes exactly
``--max-tokens`` tokens (``ignore_eos``), so the modes do identical work.

    python bench/serve_bench.py [--modes engine serve http] [--concurrency 1 8 32] [--no-report]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.report import markdown_table, update_section  # noqa: E402
from bench.workloads import mixed_requests  # noqa: E402

from keyserve.cluster.launcher import free_port  # noqa: E402
from keyserve.config import ServeConfig  # noqa: E402


@dataclass
class Sample:
    ttft: float
    tpot: float | None
    e2e: float


@dataclass
class Result:
    mode: str
    concurrency: int
    samples: list[Sample] = field(default_factory=list)
    wall: float = 0.0
    errors: int = 0

    def pct(self, attr: str, q: float) -> float:
        values = sorted(v for s in self.samples if (v := getattr(s, attr)) is not None)
        if not values:
            return float("nan")
        return statistics.median(values) if q == 0.5 else values[round(q * (len(values) - 1))]

    @property
    def throughput(self) -> float:
        return len(self.samples) / self.wall if self.wall else 0.0


async def closed_loop(requests: list, concurrency: int, one) -> tuple[list[Sample], float, int]:
    """``concurrency`` clients, each sending the next request when its last one is done."""
    queue = list(reversed(requests))
    samples: list[Sample] = []
    errors = 0

    async def client() -> None:
        nonlocal errors
        while queue:
            req = queue.pop()
            try:
                samples.append(await one(req))
            except Exception as e:  # noqa: BLE001 — counted and reported
                errors += 1
                print(f"request failed: {e!r}", file=sys.stderr)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return samples, time.perf_counter() - start, errors


def sample(start: float, first: float | None, end: float, tokens: int) -> Sample:
    first = first if first is not None else end
    return Sample(first - start, (end - first) / (tokens - 1) if tokens > 1 else None, end - start)


# ------------------------------------------------------------------ engine mode
async def run_engine(args, requests, levels) -> list[Result]:
    from keyserve.core.sampling_params import SamplingParams
    from keyserve.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(server_config(args).engine_config(), max_queued_requests=1024)
    await engine.wait_ready()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    async def one(req) -> Sample:
        start, first = time.perf_counter(), None
        async for out in engine.generate(prompt_token_ids=req.prompt_token_ids, params=params):
            if first is None and out.token_ids:
                first = time.perf_counter()
        return sample(start, first, time.perf_counter(), len(out.token_ids))

    try:
        await one(requests[0])  # warm-up
        results = []
        for c in levels:
            samples, wall, errors = await closed_loop(requests_for(requests, c, args), c, one)
            results.append(Result("engine", c, samples, wall, errors))
            report_line(results[-1])
        return results
    finally:
        engine.shutdown()


# -------------------------------------------------------------------- HTTP modes
async def run_http(mode: str, args, requests, levels) -> list[Result]:
    port = free_port()
    cmd = [sys.executable, "-m", "keyserve.cli", "serve", "--port", str(port), *server_flags(args)]
    if mode == "http":
        cmd.append("--no-ray")
    else:
        cmd += ["--num-cpus", str(args.replica_cpus)]
    proc = subprocess.Popen(cmd, env={**os.environ}, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc)
        limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
        async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:

            async def one(req) -> Sample:
                body = {"prompt": req.prompt_token_ids, "max_tokens": args.max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                start, first, tokens = time.perf_counter(), None, 0
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()!r}")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise RuntimeError(chunk["error"]["message"])
                        if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                            first = time.perf_counter()
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                end = time.perf_counter()
                return sample(start, first, end, tokens)

            await one(requests[0])  # warm-up
            results = []
            for c in levels:
                samples, wall, errors = await closed_loop(requests_for(requests, c, args), c, one)
                results.append(Result(mode, c, samples, wall, errors))
                report_line(results[-1])
            return results
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: keyserve serve shuts Serve and its local Ray down
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not become healthy")


# ------------------------------------------------------------------- plumbing
def server_config(args) -> ServeConfig:
    return ServeConfig(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                       num_blocks=args.num_blocks, max_queued_requests=1024, request_timeout_s=None)


def server_flags(args) -> list[str]:
    flags = ["--dtype", args.dtype, "--device", args.device, "--max-num-seqs", str(args.max_num_seqs),
             "--max-queued-requests", "1024"]
    if args.model:
        flags += ["--model", args.model]
    if args.num_blocks:
        flags += ["--num-blocks", str(args.num_blocks)]
    return flags


def requests_for(requests: list, concurrency: int, args) -> list:
    return requests[: max(args.min_requests, args.requests_per_client * concurrency)]


def report_line(r: Result) -> None:
    print(f"{r.mode:>6} c={r.concurrency:<3} n={len(r.samples):<4} err={r.errors} "
          f"TTFT p50={r.pct('ttft', 0.5) * 1e3:.1f}ms p99={r.pct('ttft', 0.99) * 1e3:.1f}ms "
          f"TPOT p50={r.pct('tpot', 0.5) * 1e3:.1f}ms p99={r.pct('tpot', 0.99) * 1e3:.1f}ms "
          f"{r.throughput:.2f} req/s", flush=True)


def write_report(args, results: list[Result]) -> None:
    rows = []
    engine = {r.concurrency: r for r in results if r.mode == "engine"}
    for r in results:
        base = engine.get(r.concurrency)
        over = "" if base is None or r.mode == "engine" else f"{(r.pct('ttft', 0.5) - base.pct('ttft', 0.5)) * 1e3:+.1f}"
        thr = "" if base is None or r.mode == "engine" else f"{(r.throughput / base.throughput - 1) * 100:+.1f}%"
        rows.append([r.mode, r.concurrency, len(r.samples), r.errors,
                     r.pct("ttft", 0.5) * 1e3, r.pct("ttft", 0.99) * 1e3,
                     r.pct("tpot", 0.5) * 1e3, r.pct("tpot", 0.99) * 1e3,
                     r.throughput, over, thr])
    body = (
        f"Model {args.model or 'SmolLM2-135M-Instruct'} ({args.dtype}, {args.device}), prompts "
        f"{args.prompt_min}-{args.prompt_max} tokens, {args.max_tokens} output tokens each (streaming, "
        f"`ignore_eos`), closed-loop clients; `serve` = `keyserve serve` (Ray Serve, replica with "
        f"{args.replica_cpus} CPU), `http` = `keyserve serve --no-ray` (uvicorn), `engine` = "
        "`AsyncLLMEngine` in-process. Target: overhead <= 5 ms at p50 TTFT and <= 10 % throughput at 32 clients.\n\n"
        + markdown_table(["mode", "clients", "requests", "errors", "TTFT p50 ms", "TTFT p99 ms",
                          "TPOT p50 ms", "TPOT p99 ms", "req/s", "TTFT p50 overhead ms",
                          "throughput vs engine"], rows)
    )
    update_section("serve", "Serving overhead (HTTP / Ray Serve vs engine)", body)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--modes", nargs="+", default=["engine", "serve"], choices=["engine", "serve", "http"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-min", type=int, default=64)
    p.add_argument("--prompt-max", type=int, default=256)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--replica-cpus", type=float, default=float(os.cpu_count() or 2),
                   help="CPUs the Serve replica reserves (its torch threads)")
    p.add_argument("--no-report", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from keyserve.model.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(args.model)))
    total = max(args.min_requests, args.requests_per_client * max(args.concurrency))
    requests = mixed_requests(tokenizer, num=total, prompt_range=(args.prompt_min, args.prompt_max),
                              output_range=(args.max_tokens, args.max_tokens), seed=0)
    random.Random(0).shuffle(requests)
    results: list[Result] = []
    for mode in args.modes:
        if mode == "engine":
            results += asyncio.run(run_engine(args, requests, args.concurrency))
        else:
            results += asyncio.run(run_http(mode, args, requests, args.concurrency))
    if not args.no_report:
        write_report(args, results)


if __name__ == "__main__":
    main()
