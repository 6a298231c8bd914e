"""Draft training steps in float32 and with bfloat16 matmuls (``distill-draft --train-dtype``).

Two copies of the same fresh draft (the target's layers, the committed draft's pruned head)
train side by side on the same recorded data, batch for batch with the same dropout seeds,
their steps interleaved (one float32 step, one bfloat16 step) so both see the same machine.
Reported: the median step time of each and their ratio, and the held-out agreement (float32
evaluation, the run's own held-out answers) of each after the same number of steps: a
faster step is only worth it if the draft it trains is as good.

    python bench/distill_train_bench.py --data /work/draft-work/v7 [--steps 150]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.report import BENCHMARKS_MD, markdown_table, update_section  # noqa: E402

from keyserve.model.draft_model import default_draft_dir  # noqa: E402
from keyserve.model.loader import load_model  # noqa: E402
from keyserve.training.batches import make_batch, plan_batches  # noqa: E402
from keyserve.training.dense import DenseLlama  # noqa: E402
from keyserve.training.distill import _split  # noqa: E402
from keyserve.training.export import import_draft  # noqa: E402
from keyserve.training.records import load_parts  # noqa: E402
from keyserve.training.train import TRAIN_DTYPES, TrainConfig, _train_step, eval_batches, evaluate  # noqa: E402
from keyserve.training.vocab import index_map  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="a distill-draft run directory (its data/ parts)")
    ap.add_argument("--head-from", type=Path, default=None, help="draft directory whose pruned head to use "
                    "(default: the committed draft)")
    ap.add_argument("--steps", type=int, default=150, help="training steps per dtype")
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_model(None, torch.float32, "cpu")
    data = load_parts(args.data / "data")
    if data is None:
        raise SystemExit(f"{args.data}/data holds no recorded parts")
    identity = import_draft(args.head_from or default_draft_dir())["identity"]
    head_ids = torch.tensor(identity["head_ids"], dtype=torch.int64)
    head_map = index_map(head_ids, target.config.vocab_size)
    train_seqs, heldout_seqs = _split(data, 0, int(data.prompt_index.max()) + 1)
    cfg = TrainConfig(batch_tokens=args.batch_tokens)
    heldout = eval_batches(data, heldout_seqs, head_map, cfg)
    plan = plan_batches(data, train_seqs, args.batch_tokens, random.Random(0))[: args.steps]
    models, opts = {}, {}
    for name in TRAIN_DTYPES:
        models[name] = DenseLlama.from_serving(target.model, identity["layers"], head_ids, trainable=True)
        models[name].set_dropout(0.1)
        models[name].train()
        params = [p for p in models[name].parameters() if p.requires_grad]
        opts[name] = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    initial = evaluate(models["float32"], heldout, head_ids)
    times: dict[str, list[float]] = {name: [] for name in TRAIN_DTYPES}
    tokens = 0
    loads = [os.getloadavg()[0]]
    for step, seqs in enumerate(tqdm(plan, desc="train steps (both dtypes)", unit="step")):
        batch = make_batch(data, seqs, head_map)
        tokens += batch.num_targets
        order = list(TRAIN_DTYPES) if step % 2 == 0 else list(TRAIN_DTYPES)[::-1]
        for name in order:
            torch.manual_seed(step)  # the same dropout masks for both
            t0 = time.perf_counter()
            _train_step(models[name], opts[name], batch, args.lr, 1.0, TRAIN_DTYPES[name])
            times[name].append(time.perf_counter() - t0)
    loads.append(os.getloadavg()[0])
    rows = []
    evals = {}
    base = statistics.median(times["float32"][1:])
    for name in TRAIN_DTYPES:
        step_s = statistics.median(times[name][1:])  # the first step of each warms its kernels
        ev = evals[name] = evaluate(models[name], heldout, head_ids)
        rows.append([name, f"{step_s:.3f}", f"{min(times[name][1:]):.3f}-{max(times[name][1:]):.3f}",
                     f"{base / step_s:.2f}x", round(tokens / len(plan) / step_s), f"{ev.kl:.4f}", f"{ev.top1:.4f}",
                     f"{ev.overlap_t1:.4f}"])
    md = markdown_table(["train dtype", "step s (median)", "spread s", "speed vs float32", "tokens/s",
                         "held-out KL", "held-out top-1", "held-out overlap T=1"], rows)
    summary = (f"A fresh draft (target layers {identity['layers']}, the committed draft's {head_ids.numel()}-token "
               f"head) trained {len(plan)} steps in each dtype on `{args.data}/data` ({data.num_sequences} "
               f"sequences; {len(heldout_seqs)} held out, {initial.tokens} held-out positions), "
               f"{args.batch_tokens}-token batches (~{tokens // len(plan)} predicted positions per step), AdamW at "
               f"lr {args.lr} without schedule, dropout 0.1 with the same masks in both; steps interleaved; "
               f"{args.threads} threads; 1-min load {min(loads):.2f}-{max(loads):.2f}. Held-out before training: "
               f"KL {initial.kl:.4f}, top-1 {initial.top1:.4f}. Evaluation in float32 for both.")
    print(md)
    print(summary)
    if not args.no_write:
        plot(times, {name: ev.top1 for name, ev in evals.items()}, initial.top1,
             BENCHMARKS_MD.parent / "bench_distill_train.png")
        update_section("distill_train", "Draft training steps: float32 vs bfloat16 matmuls (issue 19)",
                       f"{summary}\n\n{md}\n\n![draft training steps](bench_distill_train.png)\n")


def plot(times: dict[str, list[float]], top1: dict[str, float], top1_before: float, path: Path) -> None:
    """Left: each dtype's step times over the run (what the median summarises); right: the
    held-out top-1 each reached after the same steps, beside the start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [2, 1]})
    for name, ts in times.items():
        label = f"{name} (median {statistics.median(ts[1:]):.3f} s)"
        left.plot(range(1, len(ts)), ts[1:], ".", markersize=3, label=label)
    left.set_xlabel("training step")
    left.set_ylabel("step seconds")
    left.set_title("Draft training step time")
    left.legend(fontsize=8)
    names = ["before"] + list(top1)
    right.bar(names, [top1_before] + list(top1.values()), color=["grey"] + [f"C{i}" for i in range(len(top1))])
    right.set_ylabel("held-out top-1 agreement")
    right.set_title("After the same steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
