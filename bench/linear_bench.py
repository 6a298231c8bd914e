"""Few-row float32 products on the CPU: the native kernel against torch's ``F.linear``.

Times one pass over SmolLM2-135M-shaped weights (30 layers of q/k/v/o/gate/up/down plus the
49152-row LM head, 540 MB of float32, stored column-major as the engine stores them, so every
pass streams them from memory) for m = 1..32 rows: batch-1 decode is m = 1, a batch of B
sequences verifying K drafts each is B(K + 1). Both sides run with the same torch thread count;
the fastest of ``--reps`` passes counts. Prints a table, writes the "linear" section of
docs/BENCHMARKS.md.

    python bench/linear_bench.py [--threads 1 2] [--rows 1 2 3 4 8 16 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.report import markdown_table, update_section  # noqa: E402
from keyserve.kernels.native import library  # noqa: E402
from keyserve.kernels.native.linear import skinny_linear  # noqa: E402

HIDDEN, INTER, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30


def smollm2_weights() -> list[torch.Tensor]:  # each [out, in], column-major storage
    shapes = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
              (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS + [(VOCAB, HIDDEN)]
    return [torch.randn(o, i).t().contiguous().t() for o, i in shapes]


def pass_ms(fn, weights: list[torch.Tensor], xs: dict[int, torch.Tensor], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for w in weights:
            fn(xs[w.shape[1]], w)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if library() is None:
        sys.exit("linear_bench: the native kernels could not be built (no C compiler?)")
    weights = smollm2_weights()
    gbytes = sum(w.numel() * 4 for w in weights) / 1e9
    rows = []
    with torch.inference_mode():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for m in args.rows:
                xs = {HIDDEN: torch.randn(m, HIDDEN), INTER: torch.randn(m, INTER)}
                t_torch = pass_ms(F.linear, weights, xs, args.reps)  # interleaved per m
                t_native = pass_ms(skinny_linear, weights, xs, args.reps)  # every m, past the engine's dispatch
                rows.append([threads, m, round(t_torch, 1), round(t_native, 1),
                             f"{t_torch / t_native:.2f}×", round(gbytes / t_native * 1e3, 1)])
                print(rows[-1], flush=True)
    table = markdown_table(["threads", "rows m", "F.linear ms", "native ms", "native speed-up",
                            "native GB/s of weights"], rows)
    body = (
        f"One pass over SmolLM2-135M's float32 weights ({gbytes * 1e3:.0f} MB, column-major as the "
        "engine stores them: 30 layers and the LM head), fastest of "
        f"{args.reps}; both sides on the same torch thread count. The engine sends 2-32 rows to the "
        "native kernel, and 1 row when torch runs more than one thread "
        "(`keyserve.kernels.native.linear.supports`).\n\n" + table
    )
    print(table)
    if not args.no_write:
        update_section("linear", "CPU few-row linear: native kernel vs F.linear", body)


if __name__ == "__main__":
    main()
