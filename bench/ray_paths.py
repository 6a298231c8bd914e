"""Which step path the Ray engine should take on a CPU: the compiled graph, or plain calls (over the
actors' step channels, or as Ray actor calls), at one and two torch threads per shard, against the
in-process engine at the same thread count as the node's cores (its best on a small machine).

The compiled graph's readers (the driver, the KV-block manager, the draft actor) busy-wait on
their channels for the whole step; on a CPU whose cores the shard's threads take they spin on
those same cores. This bench is the measurement behind ``ParallelConfig.compiled_graph``'s auto
default (``use_compiled_graph``): SmolLM2-135M-Instruct float32, TP 1, greedy, ``--decode-tokens``
after a 32-token prompt, the engines taking turns, best of ``--repeats``.

    python bench/ray_paths.py [--decode-tokens 48] [--repeats 3] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.ray_bench import IDLE_RELEASE_S, PATHS, interleaved, shut_down  # noqa: E402
from bench.report import markdown_table, update_section  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = ap.parse_args()

    import ray

    from keyserve.actors.ray_engine import RayEngine
    from keyserve.actors.step_graph import use_compiled_graph
    from keyserve.config import EngineConfig
    from keyserve.core.cpu_count import usable_cpus
    from keyserve.engine.llm_engine import LLMEngine

    cores = usable_cpus()
    # what RayEngine picks with the defaults here (TP 1, no draft, no GPU)
    auto = use_compiled_graph(None, False, cores, 1, None, False)
    torch.set_num_threads(cores)
    opts = dict(num_blocks=512, device="cpu")
    ray.init(num_cpus=max(2, cores), include_dashboard=False, log_to_driver=False,
             object_store_memory=200 * 1024**2)
    engines: dict[str, object] = {}
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    try:
        engines["in-process"] = LLMEngine(EngineConfig.from_flat(**opts))
        for threads in sorted({1, cores}):
            for path in PATHS:
                engines[f"ray, {path}, {threads} thread(s)"] = RayEngine(
                    EngineConfig.from_flat(**opts, tp=1, worker_threads=threads, worker_num_cpus=0.1,
                                           compiled_graph=path == "graph", step_channels=path in ("relay", "channels"),
                                           step_relay=path == "relay", graph_idle_release_s=IDLE_RELEASE_S))
        by_batch = {b: interleaved(engines, b, args.decode_tokens, args.repeats) for b in (1, 16)}
    finally:
        shut_down(engines)
        ray.shutdown()
    rows = []
    for name in by_batch[1]:
        cells = [name]
        for b in (1, 16):
            r, base = by_batch[b][name], by_batch[b]["in-process"]
            cells += [f"{r['tok_s']:.1f}", "" if name == "in-process" else f"{1 - r['tok_s'] / base['tok_s']:.1%}",
                      f"{r['runner_ms']:.1f}"]
        rows.append(cells)
    table = markdown_table(["engine", "batch 1 tok/s", "batch 1 loss", "batch 1 runner ms/step",
                            "batch 16 tok/s", "batch 16 loss", "batch 16 runner ms/step"], rows)
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    body = (
        f"SmolLM2-135M-Instruct, float32, greedy, TP 1, {args.decode_tokens} decode tokens per request after a "
        f"32-token prompt; the in-process engine at {cores} torch threads; the engines take turns, best of "
        f"{args.repeats}. *Loss*: throughput below the in-process engine's; *runner*: the time the shard's model "
        f"runner reports for its own work per step. *relay*: the step graph relayed actor to actor over the actors' step channels (sockets, blocking reads; the default without the compiled graph); *channels*: the driver calls each actor over its step channel (`step_relay=False`); *ray calls*: plain Ray actor calls. With the defaults (`compiled_graph` auto, the shard's "
        f"threads = the node's cores) this machine picks **{'the compiled graph' if auto else 'the relay over the step channels'}**. "
        f"Load average before {load_before}, after {load_after} on {cores} cores.\n\n{table}"
    )
    print(body)
    if not args.no_write:
        update_section("ray_paths", "Ray engine on a CPU: compiled graph, step channels or Ray actor calls (issue 20)", body)


if __name__ == "__main__":
    main()
