"""The distillation loop: AdamW, warmup + cosine LR, gradient clipping, held-out evaluation,
and checkpoints with optimiser state so an interrupted run continues where it stopped.

The schedule's progress is the larger of ``step / max_steps`` and ``train time / time budget``:
on a shared CPU the speed of a step varies by several times, so a fixed step count would
either overrun the budget or stop with the learning rate still high.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from keyserve.draft.batches import Batch, distill_loss, make_batch, overlap, plan_batches
from keyserve.draft.dense import DenseLlama
from keyserve.draft.records import TeacherData
from keyserve.draft.threads import ThreadTuner


@dataclass
class TrainConfig:
    max_steps: int = 3000
    batch_tokens: int = 2048
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    grad_clip: float = 1.0
    time_budget_s: float = 1800.0
    eval_every_s: float = 120.0
    checkpoint_every_s: float = 180.0
    eval_tokens: int = 4096
    seed: int = 0
    max_threads: int = 2


@dataclass
class EvalStats:
    kl: float  # mean KL(target || draft) on held-out positions
    top1: float  # share of positions where the draft's argmax is the target's (greedy acceptance)
    overlap_t1: float  # mean sum min(p, q): acceptance probability when sampling at T = 1
    tokens: int


@dataclass
class TrainResult:
    steps: int
    train_seconds: float
    train_tokens: int
    first_loss: float
    last_loss: float
    initial_eval: EvalStats
    final_eval: EvalStats
    history: list[dict[str, float]] = field(default_factory=list)


def _trainable(model: DenseLlama) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _step_loss(model: DenseLlama, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, logits [M, N]) at the batch's predicting positions."""
    hidden = model(batch.input_ids, batch.positions)  # [B, T, hidden]
    logits = model.logits(hidden[batch.rows, batch.cols])  # [M, N]
    return distill_loss(logits, batch.teacher_idx, batch.teacher_lp), logits


@torch.no_grad()
def evaluate(model: DenseLlama, batches: list[Batch], head_ids: torch.Tensor) -> EvalStats:
    kl = top1 = ov = 0.0
    n = 0
    for batch in batches:
        loss, logits = _step_loss(model, batch)
        m = batch.num_targets
        kl += float(loss) * m
        predicted = head_ids[logits.argmax(-1)]
        top1 += float((predicted == batch.teacher_top1).sum())
        ov += float(overlap(logits, batch.teacher_idx, batch.teacher_lp).sum())
        n += m
    n = max(n, 1)
    return EvalStats(kl / n, top1 / n, ov / n, n)


def eval_batches(
    data: TeacherData, seqs: list[int], head_map: torch.Tensor, cfg: TrainConfig
) -> list[Batch]:
    """Held-out batches, capped at about ``cfg.eval_tokens`` predicted positions."""
    chosen, total = [], 0
    for i in seqs:
        if total >= cfg.eval_tokens:
            break
        chosen.append(i)
        total += int(data.gen_offsets[i + 1] - data.gen_offsets[i])
    plan = plan_batches(data, chosen, cfg.batch_tokens, random.Random(0))
    return [make_batch(data, b, head_map) for b in plan]


def _lr_factor(step: int, progress: float, cfg: TrainConfig) -> float:
    warm = min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return warm * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


class Checkpoint:
    """``checkpoint.pt``: trainable weights, optimiser, schedule and data-order state.

    Written to a temp file and renamed; read back with ``weights_only=True`` (tensors and plain
    values only, nothing that can run code)."""

    def __init__(self, path: Path, identity: dict[str, object]) -> None:
        self.path = path
        self.identity = identity  # settings a resumed run must share (layers, vocabulary, ...)

    def save(self, model: DenseLlama, opt: torch.optim.Optimizer, state: dict[str, object]) -> None:
        payload = {
            "identity": self.identity,
            "weights": {n: p.detach() for n, p in _trainable(model).items()},
            "optimizer": opt.state_dict(),
            "state": state,
        }
        tmp = self.path.with_suffix(".tmp")
        torch.save(payload, tmp)
        tmp.replace(self.path)

    def load(self, model: DenseLlama, opt: torch.optim.Optimizer) -> dict[str, object]:
        payload = torch.load(self.path, map_location="cpu", weights_only=True)
        if payload["identity"] != self.identity:
            raise ValueError(
                f"{self.path} was written by a run with different settings "
                f"({payload['identity']} vs {self.identity}); use another --out or drop --resume"
            )
        params = _trainable(model)
        with torch.no_grad():
            for name, tensor in payload["weights"].items():
                params[name].copy_(tensor)
        opt.load_state_dict(payload["optimizer"])
        return payload["state"]


def train_draft(
    model: DenseLlama,
    data: TeacherData,
    train_seqs: list[int],
    heldout_seqs: list[int],
    head_ids: torch.Tensor,  # [N] int64 full-vocab id of each draft LM-head row
    head_map: torch.Tensor,  # [vocab] int64 full id -> draft row, -1 = none
    cfg: TrainConfig,
    checkpoint: Checkpoint,
    resume: bool,
) -> TrainResult:
    """Train ``model`` in place; returns loss and held-out agreement before and after."""
    tuner = ThreadTuner(cfg.max_threads)
    params = list(_trainable(model).values())
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    heldout = eval_batches(data, heldout_seqs, head_map, cfg)
    state: dict = {"step": 0, "elapsed": 0.0, "epoch": 0, "pos": 0, "tokens": 0, "history": []}
    if resume and checkpoint.path.is_file():
        state = checkpoint.load(model, opt)
        initial = EvalStats(**state["initial_eval"])
    else:
        initial = evaluate(model, heldout, head_ids)
        state["initial_eval"] = asdict(initial)
    last_eval = initial
    bar = tqdm(total=cfg.max_steps, initial=state["step"], desc="distil draft", unit="step",
               dynamic_ncols=True)
    ema: float | None = None
    plan = plan_batches(data, train_seqs, cfg.batch_tokens, random.Random(cfg.seed + state["epoch"]))
    start = time.monotonic() - state["elapsed"]
    last_eval_t = last_ckpt_t = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        progress = max(state["step"] / cfg.max_steps, elapsed / cfg.time_budget_s)
        if progress >= 1.0:
            break
        if state["pos"] >= len(plan):
            state["epoch"], state["pos"] = state["epoch"] + 1, 0
            plan = plan_batches(data, train_seqs, cfg.batch_tokens, random.Random(cfg.seed + state["epoch"]))
        batch = make_batch(data, plan[state["pos"]], head_map)
        lr = cfg.lr * _lr_factor(state["step"], progress, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        loss, _ = _step_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        value = float(loss.detach())
        state["first_loss"] = state.get("first_loss", value)
        ema = value if ema is None else 0.9 * ema + 0.1 * value
        state["step"] += 1
        state["pos"] += 1
        state["tokens"] += batch.num_targets
        state["elapsed"] = time.monotonic() - start
        state["last_loss"] = value
        tuner.maybe_retune()
        now = time.monotonic()
        if now - last_eval_t > cfg.eval_every_s:
            last_eval = evaluate(model, heldout, head_ids)
            state["history"].append({"step": state["step"], "loss": ema, **asdict(last_eval)})
            last_eval_t = time.monotonic()
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", top1=f"{last_eval.top1:.3f}", lr=f"{lr:.1e}",
                        ep=state["epoch"], thr=tuner.threads)
        if now - last_ckpt_t > cfg.checkpoint_every_s:
            checkpoint.save(model, opt, state)
            last_ckpt_t = time.monotonic()
    bar.close()
    final = evaluate(model, heldout, head_ids)
    state["history"].append({"step": state["step"], "loss": ema or 0.0, **asdict(final)})
    state["final_eval"] = asdict(final)
    checkpoint.save(model, opt, state)
    return TrainResult(
        steps=state["step"],
        train_seconds=state["elapsed"],
        train_tokens=state["tokens"],
        first_loss=state.get("first_loss", float("nan")),
        last_loss=state.get("last_loss", float("nan")),
        initial_eval=initial,
        final_eval=final,
        history=state["history"],
    )
