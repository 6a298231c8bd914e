"""The engine's own cost per step: step time minus the model's own time, on stories260K.

stories260K's forward costs almost nothing, so what a step costs beyond it is the engine:
scheduling, block bookkeeping, packing inputs, sampling bookkeeping, stop checks,
detokenisation, outputs. On a GPU, where a SmolLM2-sized forward takes a few milliseconds,
this overhead alone would cap the server, so issue 18 bounds it: <= 1 ms per step at batch 1
and <= 2 ms at batch 64.

"The model's own time" is the time inside ``model.forward`` and ``model.compute_logits``
(timed by wrapping them on the loaded model); everything else in ``LLMEngine.step`` is
overhead. Greedy decode steps with every request running (short prompts, ignore_eos), after a
warm-up. Both wall-clock and this process's CPU time are reported (CPU time is what load from
other processes disturbs least); each batch size is the best of ``--reps`` runs of ``--steps``
steps. A cProfile of the largest batch's steps names where the overhead goes.

    python bench/engine_overhead_bench.py [--batches 1 4 16 64] [--threads 1] [--no-write]

Set PYTHONPATH to another checkout's src/ to measure that one (before/after).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.report import markdown_table, update_section  # noqa: E402

from keyserve.config import EngineConfig  # noqa: E402
from keyserve.core.sampling_params import SamplingParams  # noqa: E402
from keyserve.engine.llm_engine import LLMEngine  # noqa: E402

STORIES = Path(os.environ.get("KEYSERVE_STORIES260K",
                              Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260k"))
TARGETS_MS = {1: 1.0, 64: 2.0}  # issue 18


class ModelClock:
    """Accumulates wall and CPU time spent inside the model's forward and LM head."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.wall = self.cpu = 0.0
        for name in ("forward", "compute_logits"):
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, fn):  # noqa: ANN001, ANN202 - a thin wrapper
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - w
                self.cpu += time.process_time() - c
        return run


def build(batch: int, max_tokens: int) -> tuple[LLMEngine, ModelClock]:
    engine = LLMEngine(EngineConfig.from_flat(model=str(STORIES), max_num_seqs=max(batch, 1)))
    clock = ModelClock(engine.runner.model)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([1, 2 + i % 50, 3, 4, 5], params, request_id=f"r{i}")
    for _ in range(8):  # prompts computed, every sequence decoding
        engine.step()
    return engine, clock


def measure(batch: int, steps: int, reps: int) -> dict[str, float]:
    engine, clock = build(batch, max_tokens=8 + steps * reps + 8)
    best: dict[str, float] | None = None
    for _ in range(reps):
        clock.wall = clock.cpu = 0.0
        w, c = time.perf_counter(), time.process_time()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - w) / steps * 1e3
        cpu = (time.process_time() - c) / steps * 1e3
        row = {"step_ms": wall, "model_ms": clock.wall / steps * 1e3, "overhead_ms": wall - clock.wall / steps * 1e3,
               "cpu_step_ms": cpu, "cpu_overhead_ms": cpu - clock.cpu / steps * 1e3}
        if best is None or row["cpu_overhead_ms"] < best["cpu_overhead_ms"]:
            best = row
    assert best is not None
    return best


def profile(batch: int, steps: int, top: int) -> str:
    """The engine functions with the most own time over ``steps`` steps (model excluded)."""
    engine, _ = build(batch, max_tokens=8 + steps + 8)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (path, line, fn), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "/keyserve/" not in path or "/keyserve/model/" in path or "/keyserve/kernels/" in path:
            continue
        name = f"{path.split('/keyserve/')[-1]}:{line} {fn}"
        rows.append((tottime, [name, f"{ncalls / steps:.0f}", f"{tottime / steps * 1e3:.3f}",
                               f"{cumtime / steps * 1e3:.3f}"]))
    rows.sort(key=lambda r: -r[0])
    return markdown_table(["function", "calls/step", "own ms/step", "cumulative ms/step"],
                          [r for _, r in rows[:top]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile-top", type=int, default=15)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    rows = []
    for batch in args.batches:
        r = measure(batch, args.steps, args.reps)
        target = TARGETS_MS.get(batch)
        met = "" if target is None else ("met" if r["overhead_ms"] <= target else "missed")
        rows.append([batch, r["step_ms"], r["model_ms"], r["overhead_ms"], r["cpu_overhead_ms"],
                     "-" if target is None else f"<= {target:g} ms: {met}"])
        print(f"batch {batch:3d}: step {r['step_ms']:.2f} ms, model {r['model_ms']:.2f} ms, "
              f"overhead {r['overhead_ms']:.2f} ms (CPU {r['cpu_overhead_ms']:.2f} ms)", flush=True)
    load_after = os.getloadavg()[0]
    table = markdown_table(["batch", "step ms", "model ms", "overhead ms (wall)", "overhead ms (CPU time)",
                            "target"], rows)
    prof = profile(max(args.batches), args.steps, args.profile_top)
    print(table, "\n", prof, sep="\n")
    if args.no_write:
        return
    body = (
        f"stories260K, greedy decode with every request running, {args.threads} thread(s), best of "
        f"{args.reps} x {args.steps} steps per batch size. Overhead = step time minus the time inside "
        f"the model's forward and LM head. Load average (1 min) {load_before:.2f} before, "
        f"{load_after:.2f} after.\n\n{table}\n\n"
        f"Where the overhead goes at batch {max(args.batches)} (cProfile of {args.steps} steps, "
        f"engine functions only, profiler overhead included):\n\n{prof}\n"
    )
    update_section("engine_overhead", "Engine overhead per step (stories260K)", body)


if __name__ == "__main__":
    main()
