"""Batch-1 decode beside a busy neighbour: the native step's threads fixed vs governed.

The native decode step meets its OpenMP team at ~180 barriers per step; when another process
takes one of the cores, each barrier can wait out a scheduler time slice. The thread governor
(core/thread_governor.py) times all threads against one and runs the faster. This bench
measures, in interleaved rounds, batch-1 decode tok/s (model forward + LM head, median step) of
SmolLM2-135M-Instruct in four settings: quiet / beside ``--neighbours`` busy processes (each a
pure-Python spin loop, one core's worth of demand), with the governor on / off (threads pinned
to ``--threads``). Writes the "contention" section of docs/BENCHMARKS.md.

    python bench/contention_bench.py [--threads 2] [--rounds 3] [--steps 64] [--neighbours 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.decode_bench import Decoder  # noqa: E402
from bench.report import markdown_table, update_section  # noqa: E402
from keyserve.core.thread_governor import ThreadGovernor  # noqa: E402
from keyserve.kernels.native import library  # noqa: E402
from keyserve.model.loader import load_model  # noqa: E402

SPIN = "import time\nend = time.monotonic() + {secs}\nwhile time.monotonic() < end: pass\n"


def decode_rate(model, governed: bool, steps: int, prompt: int) -> tuple[float, dict[int, int]]:
    """Median-step tok/s of ``steps`` batch-1 steps, and how many ran at each thread count."""
    stack = model._native_decode
    stack.governor = ThreadGovernor() if governed else None
    used: dict[int, int] = {}

    def count_choice() -> None:
        if stack.governor:
            now = stack.governor.current(1) or torch.get_num_threads()
            used[now] = used.get(now, 0) + 1

    times = Decoder(model, 1, prompt, steps).timed_steps(steps, count_choice)
    return 1.0 / statistics.median(times), used


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=30)
    ap.add_argument("--neighbours", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if library() is None:
        sys.exit("contention_bench: the native kernels could not be built (no C compiler?)")
    torch.set_num_threads(args.threads)
    model = load_model(None, dtype=getattr(torch, args.dtype), progress=False).model
    if model._native_decode is None:
        sys.exit("contention_bench: this model does not take the native decode step")
    decode_rate(model, True, 8, args.prompt)  # warm-up
    samples: dict[tuple[str, str], list[float]] = {}
    loads: dict[str, list[float]] = {"quiet": [], "busy": []}
    chose: dict[int, int] = {}
    settings = [(e, g) for e in ("quiet", "busy") for g in ("governed", "pinned")]
    bar = tqdm(total=args.rounds * len(settings), desc="contention bench", unit="run")
    for r in range(args.rounds):
        for env, gov in settings[r % 2 :] + settings[: r % 2]:  # rotate the order per round
            procs = []
            if env == "busy":
                code = SPIN.format(secs=600)
                procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(args.neighbours)]
                time.sleep(1.0)
            try:
                loads[env].append(os.getloadavg()[0])
                rate, used = decode_rate(model, gov == "governed", args.steps, args.prompt)
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
            samples.setdefault((env, gov), []).append(rate)
            if env == "busy" and gov == "governed":
                for t, n in used.items():
                    chose[t] = chose.get(t, 0) + n
            bar.update(1)
            print(f"round {r}: {env:5s} {gov:8s} {rate:6.1f} tok/s", flush=True)
    bar.close()
    rows = []
    for env, gov in settings:
        xs = samples[(env, gov)]
        rows.append([env if env == "quiet" else f"beside {args.neighbours} busy process(es)", gov,
                     f"{statistics.median(xs):.1f}", f"{min(xs):.1f}-{max(xs):.1f}"])
    table = markdown_table(["machine", "threads", "tok/s (median of rounds)", "range"], rows)
    quiet = statistics.median(samples[("quiet", "governed")]) / statistics.median(samples[("quiet", "pinned")])
    busy = statistics.median(samples[("busy", "governed")]) / statistics.median(samples[("busy", "pinned")])
    body = (
        f"SmolLM2-135M-Instruct {args.dtype}, batch-1 decode (model forward + LM head, median of "
        f"{args.steps} steps after a {args.prompt}-token prompt), --threads {args.threads}, "
        f"{args.rounds} interleaved rounds. 'pinned': the native step always runs {args.threads} "
        "threads (KEYSERVE_THREAD_GOVERNOR=0); 'governed': the thread governor runs "
        f"{args.threads} threads and tries one when they get slower than usual, keeping the faster. Busy neighbour: a pure-Python "
        f"spin loop per process. 1-minute load average: quiet {min(loads['quiet']):.2f}-"
        f"{max(loads['quiet']):.2f}, busy {min(loads['busy']):.2f}-{max(loads['busy']):.2f}.\n\n"
        f"{table}\n\nGoverned ÷ pinned: {quiet:.2f}× on the quiet machine (what it costs there), "
        f"{busy:.2f}× beside the busy neighbour. Beside it the governor's choice per step was "
        f"{', '.join(f'{n} steps at {t} thread(s)' for t, n in sorted(chose.items()))}."
    )
    print(body)
    if not args.no_write:
        update_section("contention", "Batch-1 decode beside a busy process: thread governor", body)


if __name__ == "__main__":
    main()
