"""The Ray engine against the in-process engine, SmolLM2-135M-Instruct, float32, this machine.

1. decode throughput at batch 1 and 16: ``RayEngine`` at TP = 1 (one shard actor, the
   KV-block manager actor) against ``LLMEngine`` with the same torch threads, on each step path:
   one Ray Compiled Graph per step, plain calls over the actors' step channels (sockets), and
   plain Ray actor calls from the driver;
2. the per-step orchestration overhead (Ray step time minus in-process step time) and the Ray
   share of it: the time the driver waits in Ray calls (the compiled graph's submit and read,
   or the plain path's KV-block manager and target group calls) beyond the runner's own work;
3. TP = 2 and 3 (graph and channels) against TP = 1 on the Ray engine (on a 2-core machine this
   shows overhead, not speed-up: the shards share two cores and add two all-reduces per layer);
4. multi-step scheduling (``--num-scheduler-steps``, ``core/multi_step.py``): the in-process
   engine and the TP = 1 graph and relay paths with N decode steps per scheduling round, each
   against the in-process engine with the same N (per decode step: a round's time / N).

Each figure is the best of ``--repeats`` timed runs after a warm-up (the machine may be shared).

    python bench/ray_bench.py [--decode-tokens 48] [--threads 1] [--repeats 3] [--tp 2 3]
                              [--multi-step 4] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.ray_floor import graph_floor  # noqa: E402
from bench.report import markdown_table, update_section  # noqa: E402
from bench.workloads import documents  # noqa: E402

BATCHES = (1, 16)
# The step paths: the compiled graph; the same graph relayed actor to actor over the step
# channels (the default on a CPU without cores to spare); the driver calling each actor over
# its step channel (``step_relay=False``); plain Ray actor calls (``step_channels=False``).
PATHS = ("graph", "relay", "channels", "ray calls")
# The engines take turns: a waiting engine's compiled graph is released this soon, so its
# busy-waiting actors do not take the cores of the one being timed (each timed run compiles
# again in its untimed prefill steps).
IDLE_RELEASE_S = 0.3


class Timer:
    """Wraps a bound method and sums the seconds spent in it."""

    def __init__(self, obj: object, name: str) -> None:
        self.obj, self.name, self.total = obj, name, 0.0
        self.inner: Callable = getattr(obj, name)
        setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - t

    def remove(self) -> None:
        vars(self.obj).pop(self.name, None)


class RunnerTime:
    """Sums the seconds the model runner (rank 0) reports for its own work, read from each
    step's output as the engine accepts it (the same for every engine)."""

    def __init__(self, engine: object) -> None:
        self.engine, self.total = engine, 0.0
        self.inner: Callable = engine._accept  # type: ignore[attr-defined]
        engine._accept = self  # type: ignore[attr-defined]

    def __call__(self, step, out):
        self.total += out.execute_s
        return self.inner(step, out)

    def remove(self) -> None:
        vars(self.engine).pop("_accept", None)


def ray_calls(engine) -> list[Timer]:
    """Timers on where the driver waits for Ray: the graph's run (compiled or relayed), or the
    plain path's KV-block manager call and target group call (the draft call rides inside them)."""
    if not hasattr(engine, "core_client"):
        return []
    if engine.compiled_graph or engine.relayed:
        assert engine._graph is not None, "built by the steps before"
        return [Timer(engine._graph, "submit"), Timer(engine._graph, "read")]
    return [Timer(engine.core, "schedule"), Timer(engine.runner, "execute")]


def prompts(tokenizer, count: int, length: int = 32) -> list[list[int]]:
    """Distinct prompts (no prefix-cache hits between them)."""
    ids = tokenizer.encode(" ".join(text for _, text in documents()[:4])[: 8 * count * length])
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def decode(engine, batch: int, decode_tokens: int) -> dict[str, float]:
    """Prefill ``batch`` requests, then time the steps that decode ``decode_tokens`` more each."""
    from keyserve import SamplingParams

    params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True)
    for p in prompts(engine.tokenizer, batch):
        engine.add_request(p, params, prompt_token_ids=p)
    while any(not r.seqs[0].output_token_ids for r in engine.requests.values()):
        engine.step()
    runner = RunnerTime(engine)
    calls = ray_calls(engine)
    start = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        runner.remove()
        for t in calls:
            t.remove()
    elapsed = time.perf_counter() - start
    if hasattr(engine, "flush"):
        engine.flush()
    ray_s = sum(t.total for t in calls)
    steps = decode_tokens  # decode steps (positions), whatever number of them one engine step runs
    return {
        "tok_s": batch * decode_tokens / elapsed,
        "step_ms": 1e3 * elapsed / steps,
        "runner_ms": 1e3 * runner.total / steps,
        "ray_ms": 1e3 * max(0.0, ray_s - runner.total) / steps if calls else 0.0,
        "orchestration_ms": 1e3 * (elapsed - runner.total) / steps,  # all but the runner's own work
    }


def interleaved(engines: dict[str, object], batch: int, decode_tokens: int, repeats: int) -> dict[str, dict]:
    """Each engine's best run, the engines taking turns (a shared machine's load hits all alike)."""
    for engine in engines.values():
        decode(engine, batch, decode_tokens)  # warm-up (and the graph's compilation)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            # the engine before has its graph's actors busy-waiting until its idle release: they
            # would take cores from the engine timed next for that long
            time.sleep(IDLE_RELEASE_S + 0.3)
            runs[name].append(decode(engine, batch, decode_tokens))
    out = {}
    for name, results in runs.items():
        r = out[name] = min(results, key=lambda r: r["step_ms"])
        print(f"{name:16s} batch {batch:2d}: {r['tok_s']:8.1f} tok/s  {r['step_ms']:8.2f} ms/step  "
              f"outside the runner {r['orchestration_ms']:.2f} ms  waiting in Ray {r['ray_ms']:.2f} ms", flush=True)
    return out


def shut_down(engines: dict[str, object]) -> None:
    """Stop every Ray engine (their actors) and forget them all."""
    for engine in engines.values():
        if hasattr(engine, "shutdown"):
            engine.shutdown()
    engines.clear()


def round_trip_ms(engine, n: int = 200) -> float:
    """A bare actor call (``ready``) on the KV-block manager: Ray's floor per round trip."""
    import ray

    actor = engine.core_client.actor
    ray.get(actor.ready.remote())
    t = time.perf_counter()
    for _ in range(n):
        ray.get(actor.ready.remote())
    return 1e3 * (time.perf_counter() - t) / n


def plot(targets: list[list], path: Path) -> None:
    """The TP = 1 target table as two bar charts: orchestration per decode step and throughput
    loss against the in-process engine, per path, batch 1 and 16, with the targets' lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = list(dict.fromkeys(row[0] for row in targets))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.38
    for k, (batch, color) in enumerate(((1, "#4c72b0"), (16, "#dd8452"))):
        rows = {row[0]: row for row in targets if row[1] == batch}
        xs = [i + (k - 0.5) * width for i in range(len(paths))]
        left.bar(xs, [rows[p][2] for p in paths], width, color=color, label=f"batch {batch}")
        right.bar(xs, [float(str(rows[p][4]).rstrip("%")) for p in paths], width, color=color,
                  label=f"batch {batch}")
    left.axhline(1.0, color="black", linestyle="--", linewidth=1, label="target 1 ms")
    right.axhline(5.0, color="#4c72b0", linestyle="--", linewidth=1, label="target, batch 1")
    right.axhline(3.0, color="#dd8452", linestyle="--", linewidth=1, label="target, batch 16")
    for ax, title in ((left, "Ray orchestration, ms per decode step"), (right, "throughput loss vs in-process, %")):
        ax.set_xticks(range(len(paths)), paths, rotation=30, ha="right")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the in-process engine and of a TP=1 shard (TP=N: threads // N, "
                         "at least 1); 1 avoids OpenMP spinning on a shared machine")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--tp", type=int, nargs="*", default=[2, 3],
                    help="tensor-parallel sizes compared with TP = 1 (one that does not fit the model is skipped, "
                    "named in the report: SmolLM2-135M's 9 heads take 3, not 2)")
    ap.add_argument("--multi-step", type=int, default=4,
                    help="decode steps per scheduling round of the multi-step engines (in-process, TP=1 graph and "
                    "relay); 1 runs none")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = ap.parse_args()
    multi = args.multi_step if args.multi_step > 1 else None

    import ray

    from keyserve.actors.ray_engine import RayEngine
    from keyserve.actors.target_shard_actor import check_tp_fits
    from keyserve.config import EngineConfig
    from keyserve.engine.build import weight_bytes
    from keyserve.engine.llm_engine import LLMEngine

    torch.set_num_threads(args.threads)
    opts = dict(model=args.model, num_blocks=args.num_blocks, device="cpu")

    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
             object_store_memory=200 * 1024**2)
    engines: dict[str, object] = {}
    skipped = []
    try:
        engines["in-process"] = LLMEngine(EngineConfig.from_flat(**opts))
        if multi:
            engines[f"in-process x{multi}"] = LLMEngine(EngineConfig.from_flat(**opts, num_scheduler_steps=multi))
        arch = engines["in-process"].loaded.config  # type: ignore[attr-defined]
        by_batch: dict[int, dict[str, dict]] = {b: {} for b in BATCHES}
        rtt = 0.0
        # TP = 1 first, then each larger size in a round of its own beside the in-process engine:
        # every shard process a size adds (and its memory) is gone before the next is timed.
        for tp in (1, *args.tp):
            try:
                check_tp_fits(arch, tp)
            except ValueError as e:
                skipped.append(f"TP = {tp}: {e}")
                continue
            runs = [(path, 1) for path in (PATHS if tp == 1 else PATHS[:2])]
            if tp == 1 and multi:
                runs += [(path, multi) for path in PATHS[:2]]
            remote: dict[str, object] = {}
            for path, steps in runs:
                remote[f"ray tp={tp} {path}" + (f" x{steps}" if steps > 1 else "")] = RayEngine(EngineConfig.from_flat(
                    **opts, tp=tp, worker_threads=max(1, args.threads // tp), worker_num_cpus=0.1,
                    compiled_graph=path == "graph", step_channels=path in ("relay", "channels"),
                    step_relay=path == "relay", num_scheduler_steps=steps,
                    graph_idle_release_s=IDLE_RELEASE_S))
            engines.update(remote)
            if tp == 1:
                rtt = round_trip_ms(engines["ray tp=1 graph"])
            local = {k: v for k, v in engines.items() if k.startswith("in-process")}
            for b in BATCHES:
                timed = interleaved({**local, **remote} if tp == 1 else {"in-process": local["in-process"], **remote},
                                    b, args.decode_tokens, args.repeats)
                for name, r in timed.items():
                    if tp == 1 or not name.startswith("in-process"):  # the TP = 1 round's baselines stand
                        by_batch[b][name] = r
            shut_down(remote)
            for name in list(engines):
                if name.startswith("ray "):
                    del engines[name]
        model_bytes = weight_bytes(engines["in-process"].loaded.model)  # type: ignore[attr-defined]
        shut_down(engines)  # the floor is timed alone
        floor = graph_floor(model_bytes, args.threads)
        for shape, f in floor.items():
            if shape == "read":
                print(f"driver's read of a ready result: {f}", flush=True)
                continue
            print(f"graph floor ({shape}): {f['median']:.2f} ms/step beyond the stand-in's work "
                  f"(p10 {f['p10']:.2f}, p90 {f['p90']:.2f})", flush=True)
    finally:
        shut_down(engines)
        ray.shutdown()
    results = {name: {b: by_batch[b][name] for b in BATCHES} for name in by_batch[BATCHES[0]]}

    def baseline(name: str) -> dict:
        """The in-process engine with the same steps per round."""
        return results[f"in-process x{multi}"] if multi and name.endswith(f" x{multi}") else results["in-process"]

    rows = []
    for name, res in results.items():
        base = baseline(name)
        local = name.startswith("in-process")
        for b in BATCHES:
            r = res[b]
            over = r["orchestration_ms"] - base[b]["orchestration_ms"]
            rows.append([name, b, round(r["tok_s"], 1), round(r["step_ms"], 2), round(r["orchestration_ms"], 2),
                         "" if local else round(over, 2),
                         "" if local else round(r["ray_ms"], 2),
                         f"{r['tok_s'] / base[b]['tok_s'] - 1:+.1%}",
                         f"{r['tok_s'] / results['in-process'][b]['tok_s'] - 1:+.1%}"])
    table = markdown_table(["engine", "batch", "decode tok/s", "ms/decode step", "ms/decode step outside the runner",
                            "Ray orchestration ms/decode step", "waiting in Ray ms/decode step",
                            "tok/s vs in-process, same steps per round", "tok/s vs in-process, 1 step per round"], rows)
    targets = []
    for mode in list(PATHS) + ([f"{p} x{multi}" for p in PATHS[:2]] if multi else []):
        r1 = results[f"ray tp=1 {mode}"]
        base = baseline(mode)
        for b, limit in ((1, 0.05), (16, 0.03)):
            over = r1[b]["orchestration_ms"] - base[b]["orchestration_ms"]
            loss = 1 - r1[b]["tok_s"] / base[b]["tok_s"]
            per_round = multi if multi and mode.endswith(f" x{multi}") else 1  # the floor is paid once a round
            floor_share = floor["step-shaped"]["median"] / per_round / base[b]["step_ms"]
            targets.append([mode, b, round(over, 2), "yes" if over <= 1.0 else "no",
                            f"{loss:.1%}", "yes" if loss <= limit else "no", f"{floor_share:.1%}"])
    target_table = markdown_table(["TP=1 path", "batch", "orchestration ms/decode step", "<= 1 ms",
                                   "throughput loss", "<= 5 % (batch 1) / 3 % (batch 16)",
                                   "the graph floor's share of an in-process step"], targets)
    step_floor, one_floor, idle_floor = floor["step-shaped"], floor["one actor"], floor["step-shaped, idle"]
    reads = floor["read"]
    floor_note = (
        f"**This machine's floor.** A compiled graph of the step's shape (driver -> an actor with two "
        f"outputs -> an actor -> driver, `bench/ray_floor.py`) whose actors do no engine work -- the "
        f"first returns its input twice, the second streams {model_bytes / 2**20:.0f} MiB of weights "
        f"(the model's) through matrix-vector products on {args.threads} thread(s), as a decode step "
        f"does -- adds {step_floor['median']:.2f} ms per step beyond the second actor's own work "
        f"(p10 {step_floor['p10']:.2f}, p90 {step_floor['p90']:.2f}); with a single actor (driver -> "
        f"actor -> driver) {one_floor['median']:.2f} ms (p10 {one_floor['p10']:.2f}). Back to back, the "
        f"second actor idle, the step-shaped graph adds {idle_floor['median']:.2f} ms. What the wait "
        f"adds is each process's first steps after it: the driver's read of a result that is already "
        f"there takes {reads['after 20 ms']:.2f} ms after a 20 ms sleep and {reads['after 0.5 ms']:.2f} ms "
        f"after 0.5 ms. So on this machine no compiled graph of this shape -- the roles the issue keeps: "
        f"the KV-block manager, then the shards -- can cost less than {step_floor['median']:.2f} ms of "
        f"orchestration; at batch 1 that floor alone is the share of an in-process step in the last "
        f"column. The step channels (blocking socket reads, nobody spins) are not bound by it."
    )
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    body = (
        f"{args.model or 'SmolLM2-135M-Instruct'}, float32, greedy, {args.decode_tokens} decode tokens per request after "
        f"a 32-token prompt; torch threads {args.threads} (TP=N: {args.threads} // N, at least 1, per shard); "
        f"the engines take turns, best of {args.repeats}. Every figure is per decode step (one token "
        f"per request); *xN*: multi-step scheduling, N decode steps per scheduling round "
        f"(`--num-scheduler-steps N`), compared with the in-process engine at the same N. "
        f"*graph*: each step one execution of the Ray Compiled "
        f"Graph (KV-block manager -> target shards, shared-memory channels); *relay*: the same graph over the "
        f"actors' step channels (sockets, blocking reads): the driver sends the KV-block manager its request, "
        f"the KV-block manager hands the step to shard rank 0, which hands it on to the other ranks, the shards answer the driver; *channels*: the "
        f"driver calls the KV-block manager, then the target group, each over its step channel; *ray calls*: "
        f"the same calls as Ray actor calls. TP > 1 runs the first two, each size in a round of its own after the TP = 1 engines are shut down (beside the in-process engine again; the table's in-process rows are from the TP = 1 round). *Outside the runner* is a step's wall time minus the time "
        f"the model runner (rank 0) reports for its own work; the Ray orchestration cost is that figure for "
        f"Ray minus the in-process one. *Waiting in Ray* is the time the driver spends in the graph's "
        f"submit-and-read (or the plain calls) beyond the runner's work. A bare Ray actor call costs "
        f"{rtt:.2f} ms here. Load average when run: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on "
        f"{os.cpu_count()} cores (a shared machine: throughput ratios between processes mostly measure CPU "
        f"shares).\n\n{table}\n\nTargets (issue 20), TP = 1:\n\n{target_table}\n\n{floor_note}\n\n"
        "TP > 1 on a 2-core machine shows the cost of shards sharing two cores plus two gloo "
        "all-reduces per layer and the logits gather, not a speed-up."
        + "".join(f" Not run: {why}." for why in skipped)
    )
    print(body)
    if not args.no_write:
        png = Path(__file__).resolve().parent.parent / "docs" / "bench_ray.png"
        plot(targets, png)
        body += f"\n\n![Ray orchestration and throughput loss per path]({png.name})"
        update_section("ray", "Ray engine: orchestration overhead and tensor parallelism", body)


if __name__ == "__main__":
    main()
