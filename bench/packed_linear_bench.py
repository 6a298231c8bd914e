"""bf16 products of many rows: torch's ``F.linear``, the prepacked oneDNN weight, AMX tiles.

bf16 ``F.linear`` on a CPU with AMX / AVX512-BF16 reorders the weight into oneDNN's blocked
layout on every call; ``keyserve.model.packed_linear`` does it once; where the CPU has AMX,
``keyserve.kernels.native.amx`` multiplies 2-64 rows on AMX tiles over weights it packed once.
This times one pass over SmolLM2-135M's bf16 weights as the engine holds them (30 layers of the
fused qkv, o, gate-up and down matrices, row-major) for m rows, every way, interleaved, fastest
of ``--reps``, and checks they agree. It chose where the engine uses each (AMX for 2-64 rows,
the packed oneDNN weights beyond). Prints a table, writes the "packed_linear" section of
docs/BENCHMARKS.md.

    python bench/packed_linear_bench.py [--threads 1 2] [--rows 17 32 64 256 2048]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.linear_bench import HIDDEN, INTER, LAYERS, pass_ms  # noqa: E402
from bench.report import markdown_table, update_section  # noqa: E402
from keyserve.kernels.native import amx  # noqa: E402
from keyserve.model import packed_linear  # noqa: E402

QKV = 960  # fused q, k, v rows: 9 + 2 x 3 heads of 64


def smollm2_bf16_weights() -> list[torch.Tensor]:  # each [out, in], row-major bf16
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS
    return [(torch.randn(o, i) * 0.05).to(torch.bfloat16) for o, i in shapes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 17, 24, 32, 48, 64, 256, 2048])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if not packed_linear.available():
        sys.exit("packed_linear_bench: torch has no oneDNN bf16 linear with packed weights here")
    weights = smollm2_bf16_weights()
    rows = []
    load = os.getloadavg()[0]
    with torch.inference_mode():
        use_amx = amx.available()
        for w in weights:  # packing is once per weight: not timed
            packed_linear.packed_weight(w)
            if use_amx:
                amx.packed_weight(w)
        jobs = [(t, m) for t in args.threads for m in args.rows]
        for threads, m in tqdm(jobs, desc="packed_linear", unit="case"):
            torch.set_num_threads(threads)
            xs = {HIDDEN: torch.randn(m, HIDDEN).to(torch.bfloat16), INTER: torch.randn(m, INTER).to(torch.bfloat16)}
            tiles = use_amx and amx.MIN_ROWS <= m <= amx.MAX_ROWS
            ways = [packed_linear.packed_linear] + ([amx.amx_linear] if tiles else [])
            worst = max((fn(xs[w.shape[1]], w).float() - F.linear(xs[w.shape[1]], w).float()).abs().max().item()
                        for fn in ways for w in weights[:4])
            t_plain = t_packed = t_amx = float("inf")
            for _ in range(args.reps if m <= 256 else 2):  # interleaved, one pass each
                t_plain = min(t_plain, pass_ms(F.linear, weights, xs, 1))
                t_packed = min(t_packed, pass_ms(packed_linear.packed_linear, weights, xs, 1))
                if tiles:
                    t_amx = min(t_amx, pass_ms(amx.amx_linear, weights, xs, 1))
            rows.append([threads, m, round(t_plain, 1), round(t_packed, 1),
                         round(t_amx, 1) if tiles else "—", f"{t_plain / t_packed:.2f}×",
                         f"{t_packed / t_amx:.2f}×" if tiles else "—", f"{worst:.2g}"])
            tqdm.write(str(rows[-1]))
    load = max(load, os.getloadavg()[0])
    table = markdown_table(["threads", "rows m", "F.linear ms", "packed oneDNN ms", "AMX tiles ms",
                            "packed vs F.linear", "AMX vs packed", "max |diff| vs F.linear (first layer)"], rows)
    body = (
        f"Load average up to {load:.2f}. One pass over SmolLM2-135M's "
        "bf16 layer weights (30 × fused qkv, o, gate-up, down; 270 MB), fastest of the repetitions, "
        "the ways interleaved per row count. The engine multiplies bf16 products of 2-48 rows "
        "on AMX tiles where the CPU has them, and more rows (or more than 16 without AMX) on the packed "
        "oneDNN weights (`keyserve.model.matmul.linear`); its one-call decode step uses the tiles "
        "up to 64 rows. The differences from F.linear are "
        "float32 summation order, rounded once to bf16.\n\n" + table
    )
    print(table)
    if not args.no_write:
        update_section("packed_linear", "CPU bf16 linear: prepacked oneDNN weights and AMX tiles vs F.linear", body)


if __name__ == "__main__":
    main()
