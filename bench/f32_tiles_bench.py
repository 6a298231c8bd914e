"""float32 decode steps of m rows: the register tiles (f32_block.c) against gemv.h's row kernel.

On AVX2 CPUs (no AVX-512) the float32 step's products of several rows used to stay on the row
kernel, a dot product per (x row, weight row), whose extra rows made a verification step at
batch 8 cost ~4-6 ms a row against ~7.6 ms per plain token. The AVX2 tiles (6 rows x 16 outputs)
multiply them as outer products instead. Which one a step should take from how many rows
(``KS_F32_BLOCK_MIN_ROWS``, ``f32_blocks.MIN_ROWS``) is chosen from this table.

For each m: two engines on the default model, one built with ``KEYSERVE_F32_BLOCKS=0`` (the row
kernel), one with the tiles; m requests with ``--context``-token prompts are prefilled on each,
then decode steps of exactly m rows are timed, the two engines interleaved over ``--rounds``
rounds (median reported, the load average recorded), and their greedy tokens compared.

    python bench/f32_tiles_bench.py [--rows 1 4 6 8 12 16 24 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.decode_rows_bench import decode_engine, timed  # noqa: E402
from bench.report import BENCHMARKS_MD, markdown_table, update_section  # noqa: E402

from keyserve.kernels.native import f32_blocks  # noqa: E402


def tiles_switched(side: str) -> None:
    """The switch the layer stack reads at load and the LM head at every call."""
    os.environ["KEYSERVE_F32_BLOCKS"] = "1" if side == "tiles" else "0"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 6, 8, 12, 16, 24, 32])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kind = {1: "AVX-512", 2: "AVX2"}.get(f32_blocks.kind())
    least = f32_blocks.min_rows()
    if kind is None:
        sys.exit("this build has no float32 register tiles (no AVX2/AVX-512, or KEYSERVE_F32_BLOCKS=0)")
    table, loads = [], []
    bar = tqdm(total=len(args.rows) * args.rounds, desc="f32 tiles", unit="round")
    for m in args.rows:
        engines = {}
        for side in ("rows", "tiles"):
            tiles_switched(side)
            engines[side] = decode_engine("float32", m, args.context)
            timed(engines[side], 2)  # warm-up
        assert engines["rows"].loaded.model._native_decode._packed is None
        times: dict[str, list[float]] = {side: [] for side in engines}
        for rnd in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for side in (("rows", "tiles") if rnd % 2 == 0 else ("tiles", "rows")):
                tiles_switched(side)
                times[side].append(timed(engines[side], args.steps))
            bar.update(1)
        os.environ.pop("KEYSERVE_F32_BLOCKS", None)
        same = all(a.output_token_ids == b.output_token_ids for a, b in
                   zip(engines["rows"]._seqs.values(), engines["tiles"]._seqs.values(), strict=True))
        for e in engines.values():
            e.close()
        row_ms, tile_ms = (1000 * statistics.median(times[s]) for s in ("rows", "tiles"))
        table.append([m, round(row_ms, 1), round(tile_ms, 1), round(tile_ms / row_ms, 2), "yes" if same else "no"])
        tqdm.write(f"{m} rows: row kernel {row_ms:.1f} ms, tiles {tile_ms:.1f} ms")
    bar.close()
    md = markdown_table(["rows", "row kernel ms/step", f"{kind} tiles ms/step", "tiles / row kernel",
                         "same greedy tokens"], table)
    summary = (f"SmolLM2-135M-Instruct, float32, {args.context}-token contexts; median of {args.rounds} "
               f"interleaved rounds of {args.steps} decode steps per engine, {args.threads} threads, 1-min load "
               f"{min(loads):.2f}-{max(loads):.2f}. A whole engine step (scheduling, attention, LM head, "
               f"sampling included); the tiles' side also multiplies the LM head on them from {least} rows.")
    print(md)
    print(summary)
    if not args.no_write:
        png = BENCHMARKS_MD.parent / "bench_f32_tiles.png"
        plot(table, kind, png)
        update_section("f32_tiles", f"float32 decode steps: {kind} register tiles vs the row kernel",
                       f"{summary}\n\n{md}\n\n![float32 step time by rows]({png.name})\n")


def plot(table: list[list], kind: str, path: Path) -> None:
    """Step time against rows, row kernel and tiles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ax.plot([r[0] for r in table], [r[1] for r in table], "s-", label="row kernel (gemv.h)")
    ax.plot([r[0] for r in table], [r[2] for r in table], "o-", label=f"{kind} tiles (f32_block.c)")
    ax.set_xlabel("decode rows per step")
    ax.set_ylabel("ms per step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
