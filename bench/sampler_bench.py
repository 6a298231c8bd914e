"""One sampled token per row, three ways, over SmolLM2's 49,152-token vocabulary.

Side by side in one process, interleaved: keyserve's ``core.sampler.sample`` (inverse CDF: one
float64 uniform per row, a float64 cumulative sum, ``searchsorted``), the exponential race it
replaced (and that vLLM's sampler uses: Exp(1) noise over every token, argmax of p / noise; a
seeded row draws its noise from its own generator) and ``torch.multinomial`` (what transformers'
``generate`` samples with), each after the same temperature and softmax. Rows 1 and 8, unseeded
and seeded (every row with its own ``torch.Generator``), torch threads 1 and 2.

Why: a plain batch-8 decode step at T = 0.8 cost 23 ms more than a greedy one (the tree bench,
2026-11-29), and the noise over the vocabulary was most of it (docs/BENCHMARKS.md, section
sampler). Reported: the median over ``--repeats`` interleaved rounds of the mean time of
``--calls`` calls, and each contender's time over keyserve's.

    python bench/sampler_bench.py [--repeats 5] [--calls 20]

Writes the "sampler" section of docs/BENCHMARKS.md and docs/bench_sampler.png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.report import BENCHMARKS_MD, markdown_table, update_section  # noqa: E402

VOCAB = 49_152
TEMPERATURE = 0.8


def _tensors(rows: int):  # noqa: ANN202
    from keyserve.core.sampler import SamplingTensors
    from keyserve.core.sampling_params import SamplingParams

    return SamplingTensors.from_params([SamplingParams(temperature=TEMPERATURE) for _ in range(rows)])


def _generators(rows: int, seeded: bool) -> list[torch.Generator | None]:
    from keyserve.core.sampler import make_generator

    return [make_generator(1234 + i if seeded else None, 0) for i in range(rows)]


def keyserve_sample(logits: torch.Tensor, gens: list[torch.Generator | None]) -> torch.Tensor:
    from keyserve.core.sampler import sample

    return sample(logits, _tensors(logits.shape[0]), gens)[0]


def exponential_race(logits: torch.Tensor, gens: list[torch.Generator | None]) -> torch.Tensor:
    """argmax(p / E), E ~ Exp(1) per token: a draw from p. One draw for the whole batch, then
    a seeded row's own (as keyserve did before, and as vLLM's sampler does per generator)."""
    probs = torch.softmax(logits / TEMPERATURE, dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for i, g in enumerate(gens):
        if g is not None:
            noise[i].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)


def multinomial(logits: torch.Tensor, gens: list[torch.Generator | None]) -> torch.Tensor:
    """``torch.multinomial`` as transformers' generate calls it; a seeded row alone with its
    generator (multinomial takes one generator per call)."""
    probs = torch.softmax(logits / TEMPERATURE, dim=-1)
    if all(g is None for g in gens):
        return torch.multinomial(probs, 1)[:, 0]
    return torch.cat([torch.multinomial(probs[i : i + 1], 1, generator=g)[:, 0] for i, g in enumerate(gens)])


CONTENDERS: dict[str, Callable[[torch.Tensor, list[torch.Generator | None]], torch.Tensor]] = {
    "keyserve inverse CDF": keyserve_sample,
    "exponential race (before; vLLM)": exponential_race,
    "torch.multinomial (transformers)": multinomial,
}


def _time(fn: Callable, logits: torch.Tensor, gens: list, calls: int) -> float:
    fn(logits, gens)  # warm-up
    start = time.perf_counter()
    for _ in range(calls):
        fn(logits, gens)
    return (time.perf_counter() - start) / calls * 1e3


def measure(args: argparse.Namespace) -> list[list]:
    cases = [(t, rows, seeded) for t in args.threads for rows in args.rows for seeded in (False, True)]
    times: dict[tuple, list[float]] = {}
    bar = tqdm(total=args.repeats * len(cases) * len(CONTENDERS), desc="sampler", unit="timing")
    for rnd in range(args.repeats):
        for threads, rows, seeded in cases:
            torch.set_num_threads(threads)
            logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows)) * 3
            names = list(CONTENDERS) if rnd % 2 == 0 else list(CONTENDERS)[::-1]
            for name in names:
                gens = _generators(rows, seeded)
                times.setdefault((threads, rows, seeded, name), []).append(
                    _time(CONTENDERS[name], logits, gens, args.calls))
                bar.update()
    bar.close()
    table = []
    for threads, rows, seeded in cases:
        ours = statistics.median(times[(threads, rows, seeded, "keyserve inverse CDF")])
        for name in CONTENDERS:
            ts = times[(threads, rows, seeded, name)]
            med = statistics.median(ts)
            table.append([threads, rows, "yes" if seeded else "no", name, f"{med:.2f}",
                          f"{min(ts):.2f}–{max(ts):.2f}", f"{med / ours:.2f}×"])
    return table


def plot(table: list[list], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r[0], r[1], r[2]) for r in table})
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(CONTENDERS)
    for j, name in enumerate(CONTENDERS):
        ms = [next(float(r[4]) for r in table if (r[0], r[1], r[2]) == c and r[3] == name) for c in cases]
        ax.bar([i + j * width for i in range(len(cases))], ms, width, label=name)
    ax.set_xticks([i + width for i in range(len(cases))])
    ax.set_xticklabels([f"{t} thr\n{rows} row(s)\nseeded {s}" for t, rows, s in cases], fontsize=7)
    ax.set_ylabel("ms per call (median)")
    ax.set_title(f"One sampled token per row, vocabulary {VOCAB}, T = {TEMPERATURE}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--calls", type=int, default=20, help="calls timed per contender and round")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    table = measure(args)
    body = "\n".join([
        f"Vocabulary {VOCAB}, T = {TEMPERATURE}, float32 logits (randn × 3); median over {args.repeats} "
        f"interleaved rounds of the mean of {args.calls} calls (spread: min–max over rounds). Load average "
        f"(1 min) before {load_before:.2f}, after {os.getloadavg()[0]:.2f}. \"seeded\": every row has its own "
        "generator (a request with a `seed`). vs keyserve: the contender's time over keyserve's.",
        "",
        markdown_table(["torch threads", "rows", "seeded", "sampler", "ms per call", "spread ms", "vs keyserve"], table),
        "",
        "![sampler](bench_sampler.png)",
    ])
    print(body)
    if not args.no_write:
        plot(table, BENCHMARKS_MD.parent / "bench_sampler.png")
        update_section("sampler", "Sampling one token per row: inverse CDF vs exponential race vs multinomial", body)


if __name__ == "__main__":
    main()
