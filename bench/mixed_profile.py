"""Where 64 mixed requests spend their time: every engine step timed by its kind.

The peer bench's many-request row (issue 18: >= 5x transformers' padded batches) is the sum
of three very different kinds of step: prefill/mixed chunks (GEMM-bound), decode-only steps
of at most ``MAX_ROWS`` rows (the native one-call step) and decode-only steps of more rows.
This runs the same requests (``bench/workloads.py``, same seed) through the in-process engine
and reports each kind's count, time, tokens and time per step, so the work goes where the time
is. A torch profile of a few steps of the slowest kind names the ops (``--torch-profile``).

    python bench/mixed_profile.py [--dtype bfloat16] [--threads 2] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.report import BENCHMARKS_MD, markdown_table, update_section  # noqa: E402
from bench.workloads import mixed_requests, step_until_decoding  # noqa: E402

from keyserve.config import EngineConfig  # noqa: E402
from keyserve.core.sampling_params import SamplingParams  # noqa: E402
from keyserve.engine.llm_engine import LLMEngine  # noqa: E402
from keyserve.kernels.native.gemv import MAX_ROWS  # noqa: E402

DOCS = BENCHMARKS_MD.parent


def step_kind(step, native_rows: int = MAX_ROWS) -> tuple[str, int, int]:  # noqa: ANN001 - a StepInput
    """(kind, prompt tokens, decode rows) of one scheduled step; decode steps split at the
    most rows the native decode step takes."""
    prompt = rows = 0
    for item in step.items:
        if item.sample_seq_ids and item.num_new_tokens == 1 and item.start > 0 and not item.verifies:
            rows += 1
        else:
            prompt += item.num_new_tokens
    if prompt:
        return "prefill / mixed", prompt, rows
    if rows <= native_rows:
        return f"decode, <= {native_rows} rows (native step)", 0, rows
    return f"decode, > {native_rows} rows (torch path)", 0, rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--torch-profile", type=int, default=0, help="torch-profile this many steps of the slowest kind")
    ap.add_argument("--native-rows", type=int, default=None,
                    help="most rows the native decode step takes (default: the engine's own limit)")
    ap.add_argument("--block-size", type=int, default=None, help="KV block size (default: the engine's)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens per step, the prefill chunk budget (default: the engine's)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    extra = {"block_size": args.block_size} if args.block_size else {}
    if args.max_num_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    engine = LLMEngine(EngineConfig.from_flat(dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                                              kv_cache_memory_gb=4.0, **extra))
    reqs = mixed_requests(engine.tokenizer, num=args.num_requests)
    native = getattr(engine.loaded.model, "_native_decode", None)
    if native is not None and args.native_rows is not None:
        native.max_rows = args.native_rows
    native_rows = native.max_rows if native is not None else 0
    # warm-up: one short request through prefill and a few decode steps
    engine.add_request("warm", SamplingParams(max_tokens=8, ignore_eos=True), prompt_token_ids=reqs[0].prompt_token_ids[:64])
    while engine.has_unfinished_requests():
        engine.step()
    for i, r in enumerate(reqs):
        engine.add_request(f"r{i}", SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True),
                           prompt_token_ids=r.prompt_token_ids)
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])  # steps, seconds, prompt tokens, rows
    load = os.getloadavg()[0]
    bar = tqdm(total=sum(r.max_tokens for r in reqs), desc=f"{args.dtype} mixed", unit="tok")
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        step = engine._running_step
        if step is None or step.is_empty:
            continue
        kind, prompt, rows = step_kind(step, native_rows)
        a = acc[kind]
        a[0] += 1
        a[1] += dt
        a[2] += prompt
        a[3] += rows
        bar.update(rows)
    total = time.perf_counter() - start
    bar.close()
    out_tokens = sum(r.max_tokens for r in reqs)
    rows = [[k, int(a[0]), round(a[1], 2), int(a[2]), int(a[3]), round(1000 * a[1] / max(a[0], 1), 1),
             round(100 * a[1] / total, 1)] for k, a in sorted(acc.items())]
    table = markdown_table(["step kind", "steps", "seconds", "prompt tokens", "decode rows", "ms / step", "% of time"],
                           rows)
    summary = (f"{args.num_requests} requests, {sum(len(r.prompt_token_ids) for r in reqs)} prompt and {out_tokens} "
               f"generated tokens in {total:.1f} s = **{out_tokens / total:.1f} useful tok/s** ({args.dtype}, "
               f"{args.threads} threads, load {load:.2f} before, {os.getloadavg()[0]:.2f} after)")
    print(table)
    print(summary)
    if args.torch_profile:
        profile_slowest(engine, reqs, args.torch_profile)
    if not args.no_write:
        png = DOCS / f"bench_mixed_profile_{args.dtype}.png"
        plot(acc, total, f"64 mixed requests, {args.dtype}: {out_tokens / total:.0f} useful tok/s", png)
        update_section(f"mixed_profile_{args.dtype}", f"Where 64 mixed requests spend their time ({args.dtype})",
                       f"{summary}\n\n{table}\n\n![time by step kind]({png.name})\n")


def plot(acc, total: float, title: str, path: Path) -> None:  # noqa: ANN001
    """Seconds per step kind (bars) with the time per step written on each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted(acc)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    bars = ax.barh(kinds, [acc[k][1] for k in kinds], color="#4C72B0")
    for bar, k in zip(bars, kinds):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {int(acc[k][0])} steps, {1000 * acc[k][1] / max(acc[k][0], 1):.0f} ms each", va="center", fontsize=8)
    ax.set_xlabel(f"seconds (of {total:.1f} s)")
    ax.set_xlim(0, max(acc[k][1] for k in kinds) * 1.6)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def profile_slowest(engine: LLMEngine, reqs, n: int) -> None:  # noqa: ANN001
    """A torch profile of ``n`` steps with 64 decode rows (every request in decode)."""
    for i, r in enumerate(reqs):
        engine.add_request(f"p{i}", SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True),
                           prompt_token_ids=r.prompt_token_ids)
    step_until_decoding(engine, len(reqs))
    with torch.profiler.profile() as prof:
        for _ in range(n):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
