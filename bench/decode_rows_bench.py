"""Decode steps of m rows: the one-call native step against the torch path, per row count.

The native decode step (kernels/native/decode_stack.c) runs every layer in one call with its
own few-row products; the torch path runs one op at a time but gets oneDNN's GEMMs (AMX on CPUs
that have it). Which wins depends on the rows, the dtype and the CPU, so the limit of rows the
native step takes (``NativeDecodeStack.max_rows``) is chosen from this table, not assumed.

For each m: m requests with ``--context``-token prompts are prefilled, then decode steps of
exactly m rows are timed with the native step allowed, then forbidden, interleaved over
``--rounds`` rounds on the same engine (best round reported, the load average recorded).

    python bench/decode_rows_bench.py [--dtypes float32 bfloat16] [--rows 8 16 24 32 48 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.report import BENCHMARKS_MD, markdown_table, update_section  # noqa: E402
from bench.workloads import mixed_requests, step_until_decoding  # noqa: E402

from keyserve.config import EngineConfig  # noqa: E402
from keyserve.core.sampling_params import SamplingParams  # noqa: E402
from keyserve.engine.llm_engine import LLMEngine  # noqa: E402


def decode_engine(dtype: str, rows: int, context: int) -> LLMEngine:
    """An engine with ``rows`` requests past their prompts, every step a decode step of them."""
    engine = LLMEngine(EngineConfig.from_flat(dtype=dtype, max_num_seqs=max(rows, 1), kv_cache_memory_gb=4.0))
    reqs = mixed_requests(engine.tokenizer, num=rows, prompt_range=(context, context), output_range=(10_000, 10_000))
    for i, r in enumerate(reqs):
        engine.add_request(f"r{i}", SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True),
                           prompt_token_ids=r.prompt_token_ids)
    step_until_decoding(engine, rows)
    return engine


def timed(engine: LLMEngine, steps: int) -> float:
    """Seconds per decode step over ``steps`` steps."""
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 24, 32, 48, 64])
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    table = []
    loads = []
    bar = tqdm(total=len(args.dtypes) * len(args.rows) * args.rounds, desc="decode rows", unit="round")
    for dtype in args.dtypes:
        for m in args.rows:
            engine = decode_engine(dtype, m, args.context)
            native = engine.loaded.model._native_decode
            best = {"native": float("inf"), "torch": float("inf")}
            timed(engine, 2)  # warm-up
            for _ in range(args.rounds):
                loads.append(os.getloadavg()[0])
                for side, limit in (("native", 10_000), ("torch", 0)):
                    if native is not None:
                        native.max_rows = limit
                    best[side] = min(best[side], timed(engine, args.steps))
                bar.update(1)
            engine.close()
            table.append([dtype, m, round(1000 * best["native"], 1), round(1000 * best["torch"], 1),
                          round(best["torch"] / best["native"], 2),
                          "native" if best["native"] < best["torch"] else "torch"])
            tqdm.write(f"{dtype} {m} rows: native {1000 * best['native']:.1f} ms, torch {1000 * best['torch']:.1f} ms")
    bar.close()
    md = markdown_table(["dtype", "rows", "native step ms", "torch path ms", "torch / native", "faster"], table)
    summary = (f"{args.context}-token contexts, best of {args.rounds} interleaved rounds of {args.steps} steps, "
               f"{args.threads} threads, 1-min load {min(loads):.2f}-{max(loads):.2f}. A whole engine step "
               f"(scheduling, sampling included); the native side falls back to torch where the step "
               f"is not one it takes.")
    print(md)
    print(summary)
    if not args.no_write:
        png = BENCHMARKS_MD.parent / "bench_decode_rows.png"
        plot(table, png)
        update_section("decode_rows", "Decode steps of m rows: native step vs torch path",
                       f"{summary}\n\n{md}\n\n![decode step time by rows]({png.name})\n")


def plot(table: list[list], path: Path) -> None:
    """Step time against rows, native and torch, one panel per dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r[0] for r in table})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5 * len(dtypes), 3.4), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        rows = [r for r in table if r[0] == dtype]
        ax.plot([r[1] for r in rows], [r[2] for r in rows], "o-", label="native step")
        ax.plot([r[1] for r in rows], [r[3] for r in rows], "s-", label="torch path")
        ax.set_xlabel("decode rows per step")
        ax.set_ylabel("ms per step")
        ax.set_title(dtype)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
