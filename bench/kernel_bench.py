"""Decode attention on the CPU: the paged paths against dense attention.

For SmolLM2-135M shapes (9 query heads, 3 kv heads, head_dim 64, block 16, float32) and
contexts 512 / 2k / 8k at batch 1 and 16, time one decode step of the native paged kernel (the
engine's CPU path, ``kernels/native``), of it with H2O score output, and of the pure-torch paged
path (``paged_decode_attention_reference``: block gather + SDPA), all over shuffled block tables
as a long-running pool leaves them, against ``scaled_dot_product_attention`` over the same tokens
held contiguously, in the layout a dense cache uses (``[batch, kv_heads, tokens, head_dim]``) and
in the paged cache's own token-major layout (``[batch, tokens, kv_heads, head_dim]``). The
issue's target: paged <= 1.3x dense.

    .venv/bin/python bench/kernel_bench.py [--reps 30] [--no-write]

Writes the "kernels" section of docs/BENCHMARKS.md and docs/bench_kernels.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.report import BENCHMARKS_MD, markdown_table, update_section  # noqa: E402
from keyserve.kernels.native.decode import paged_decode_attention_native  # noqa: E402
from keyserve.kernels.reference import paged_decode_attention_reference  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CONTEXTS = (512, 2048, 8192)
BATCHES = (1, 16)
TARGET = 1.3
PLOT = BENCHMARKS_MD.parent / "bench_kernels.png"
WHY_NOT_MET = (
    "Why the target is missed where it is: dense SDPA reads each sequence's K/V as one "
    "contiguous stream with a GEMM-shaped inner loop, while the native kernel reads 256-byte "
    "head rows scattered over 16-slot blocks and computes its dot products with plain SIMD "
    "loops; the pure-torch paged path additionally copies every K/V byte out of the pool "
    "before its SDPA."
)
NO_GPU_NOTE = (
    "This task had no GPU (the `device` tool reported no machine lent), so the Triton kernels "
    "were validated only under `TRITON_INTERPRET=1` on the CPU (and compiled for sm_90 through "
    "ptxas by `tests/kernels/aot_compile.py`, never run) and no GPU memory bandwidth was "
    "measured."
)
BUSY_NOTE = (
    "The machine was oversubscribed while this ran (load average above its core count), so "
    "single points are noisy (a contended call can take several times its idle time); rerun "
    "on an idle machine for precise ratios."
)


_FLUSH = torch.empty(0)


def _flush_caches() -> None:
    """Evict the last-level cache (32 MiB here) so every call reads K/V from memory, as a real
    decode step does: the other layers' caches have pushed this layer's out since it last ran.
    Without this, dense K/V up to ~12 MiB would stay hot across repetitions while the paged
    pool (larger than the batch's tokens) would not, which flatters dense unfairly."""
    global _FLUSH
    if _FLUSH.numel() == 0:
        _FLUSH = torch.empty(16 << 20)  # 64 MiB of float32
    _FLUSH.add_(1.0)


def _time_ms(fn: Callable[[], object], reps: int) -> float:
    """Fastest of ``reps`` cold-cache calls after two warm-ups, in ms. On a shared 2-core
    machine other processes stretch individual calls (both torch threads must be on a core at
    once), so the minimum is the best estimate of the uncontended time, for every contender."""
    fn()
    fn()
    best = float("inf")
    for _ in range(reps):
        _flush_caches()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _busy(load: str) -> bool:
    try:
        return float(load.split()[0]) > (os.cpu_count() or 1)
    except (ValueError, IndexError):
        return False


def _load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def _case(batch: int, ctx: int, seed: int) -> dict[str, torch.Tensor]:
    """A paged cache with shuffled block tables, plus the same tokens laid out densely."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = ctx // BLOCK
    num_blocks = 2 * batch * blocks_per_seq  # the pool is larger than the batch's contexts
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq]
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    k_tok = k_cache[tables.long()].reshape(batch, ctx, KV_HEADS, HEAD_DIM)
    v_tok = v_cache[tables.long()].reshape(batch, ctx, KV_HEADS, HEAD_DIM)
    return {
        "query": torch.randn(batch, HEADS, HEAD_DIM, generator=gen),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "tables": tables,
        "lens": torch.full((batch,), ctx, dtype=torch.int32),
        "k_tok": k_tok,  # [batch, ctx, kv_heads, head_dim] contiguous
        "v_tok": v_tok,
        "k_head": k_tok.transpose(1, 2).contiguous(),  # [batch, kv_heads, ctx, head_dim]
        "v_head": v_tok.transpose(1, 2).contiguous(),
    }


def measure(batch: int, ctx: int, reps: int) -> dict[str, float]:
    c = _case(batch, ctx, seed=batch * 100_000 + ctx)
    scale = HEAD_DIM**-0.5
    q4 = c["query"].unsqueeze(2)  # [batch, heads, 1, head_dim]

    def paged() -> torch.Tensor:
        out, _ = paged_decode_attention_reference(
            c["query"], c["k_cache"], c["v_cache"], c["tables"], c["lens"], scale)
        return out

    def native() -> torch.Tensor:
        out, _ = paged_decode_attention_native(
            c["query"], c["k_cache"], c["v_cache"], c["tables"], c["lens"], scale)
        return out

    def native_h2o() -> torch.Tensor:
        out, _ = paged_decode_attention_native(
            c["query"], c["k_cache"], c["v_cache"], c["tables"], c["lens"], scale,
            score_mode="softmax")
        return out

    def dense_head() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q4, c["k_head"], c["v_head"], scale=scale, enable_gqa=True)

    def dense_tok() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q4, c["k_tok"].transpose(1, 2), c["v_tok"].transpose(1, 2), scale=scale,
            enable_gqa=True)

    torch.testing.assert_close(paged(), dense_head().squeeze(2), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(native(), dense_head().squeeze(2), atol=1e-4, rtol=1e-4)
    fns = {"native": native, "native_h2o": native_h2o, "paged": paged, "dense": dense_head,
           "dense_tok": dense_tok}
    times: dict[str, list[float]] = {k: [] for k in fns}
    rounds = 4  # interleave the contenders so a load spike hits them alike
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(_time_ms(fn, max(reps // rounds, 3)))
    return {name: min(ts) for name, ts in times.items()}


def plot(rows: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, batch in zip(axes, BATCHES):
        sel = [r for r in rows if r["batch"] == batch]
        ctxs = [int(r["context"]) for r in sel]
        for key, label in (("native", "paged native (engine)"), ("native_h2o", "paged native + H2O scores"),
                           ("paged", "paged torch (gather + SDPA)"), ("dense", "dense SDPA [B,H,T,D]"),
                           ("dense_tok", "dense SDPA [B,T,H,D]")):
            ax.plot(ctxs, [r[key] for r in sel], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ctxs, [str(c) for c in ctxs])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per decode step (one layer)")
        ax.set_title(f"batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle("CPU decode attention, SmolLM2 shapes (9 q / 3 kv heads, d=64, block 16, fp32)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=40, help="timed calls per contender")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: torch's default); 1 is steadier on a busy machine")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_before = _load()
    rows = []
    for batch in BATCHES:
        for ctx in CONTEXTS:
            r = measure(batch, ctx, args.reps)
            rows.append({"batch": batch, "context": ctx, **r})
            print(f"batch {batch:2d} ctx {ctx:5d}: native {r['native']:.3f} ms "
                  f"({r['native'] / r['dense']:.2f}x dense), torch paged {r['paged']:.3f} ms "
                  f"({r['paged'] / r['dense']:.2f}x), dense {r['dense']:.3f} ms", flush=True)
    table = markdown_table(
        ["batch", "context", "native paged ms", "native + H2O scores ms", "torch paged ms",
         "dense ms", "native / dense", "torch paged / dense", "dense token-major ms",
         "native / token-major"],
        [[int(r["batch"]), int(r["context"]), r["native"], r["native_h2o"], r["paged"],
          r["dense"], r["native"] / r["dense"], r["paged"] / r["dense"], r["dense_tok"],
          r["native"] / r["dense_tok"]] for r in rows],
    )
    print(table)
    worst = max(r["native"] / r["dense"] for r in rows)
    verdict = (f"Target paged <= {TARGET}x dense: {'met' if worst <= TARGET else 'NOT met'} "
               f"(worst ratio {worst:.2f}x).")
    print(verdict)
    load = (f"torch threads: {torch.get_num_threads()}. Load average (1/5/15 min) before: "
            f"{load_before}; after: {_load()}.")
    print(load)
    if args.no_write:
        return
    plot(rows, PLOT)
    body = "\n\n".join([
        "One decode step of one attention layer, SmolLM2-135M shapes (9 query heads, 3 kv heads, "
        "head_dim 64), block size 16, float32, shuffled block tables. *native paged* is the "
        "engine's CPU path (`kernels/native/paged_decode.c`: reads K/V in place from the "
        "blocks, OpenMP over (sequence, kv-head)), also timed returning H2O scores; *torch "
        "paged* is `paged_decode_attention_reference` (gather of the blocks into reused "
        "head-major buffers, then fused SDPA; the path used where no C compiler is present); "
        "*dense* is `scaled_dot_product_attention` over the same "
        "tokens held contiguously as `[batch, kv_heads, tokens, head_dim]`; *dense token-major* "
        "holds them as `[batch, tokens, kv_heads, head_dim]`, the paged cache's own layout. "
        "Times (ms) are the fastest of interleaved runs, each after flushing the last-level "
        "cache (a decode step finds a layer's K/V in memory, not in cache: the other layers "
        "evicted it); the minimum estimates the uncontended time on a shared machine, for "
        "every contender alike.",
        table,
        verdict,
        *([] if worst <= TARGET else [WHY_NOT_MET]),
        load,
        *([BUSY_NOTE] if _busy(load_before) else []),
        f"![decode attention]({PLOT.name})",
        NO_GPU_NOTE,
    ])
    update_section("kernels", "Kernels: paged vs dense decode attention (CPU)", body)


if __name__ == "__main__":
    main()
