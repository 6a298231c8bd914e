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

from keyserve.training.batches import Batch, distill_loss, make_batch, overlap, plan_batches
from keyserve.training.dense import DenseLlama
from keyserve.training.records import TeacherData
from keyserve.training.threads import ThreadTuner

# The dtypes the training step's matmuls may run in (``TrainConfig.train_dtype``).
TRAIN_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


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
    dropout: float = 0.1
    seed: int = 0
    max_threads: int = 2
    keep: str = "best"  # weights returned: "best" held-out evaluation, or "last" (the final step's)
    # The training step's matmuls: "bfloat16" autocasts them (a CPU with AVX512-BF16 or AMX runs
    # them several times faster than float32); the weights, AdamW's state, the loss and the
    # held-out evaluation stay float32, so runs in either dtype are judged alike.
    train_dtype: str = "float32"
    # The training loss: KL(target || draft) + argmax_weight x cross-entropy at the target's
    # argmax (``batches.argmax_loss``, taken with the KL in ``distill_loss`` from one
    # log-softmax; greedy acceptance asks only for the argmax). 0: the KL alone. The held-out
    # evaluation reports the KL either way.
    argmax_weight: float = 0.0


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
    final_eval: EvalStats  # of the weights kept (the best held-out evaluation, or the last)
    kept_step: int
    history: list[dict[str, float]] = field(default_factory=list)


def _trainable(model: DenseLlama) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _step_loss(model: DenseLlama, batch: Batch, argmax_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, logits [M, N]) at the batch's predicting positions: the KL, plus ``argmax_weight``
    x the argmax cross-entropy (``TrainConfig.argmax_weight``; 0 for the held-out KL)."""
    hidden = model(batch.input_ids, batch.positions)  # [B, T, hidden]
    logits = model.logits(hidden[batch.rows, batch.cols])  # [M, N]
    return distill_loss(logits, batch.teacher_idx, batch.teacher_lp, argmax_weight), logits


@torch.no_grad()
def evaluate(model: DenseLlama, batches: list[Batch], head_ids: torch.Tensor) -> EvalStats:
    was_training = model.training
    model.eval()
    try:
        return _evaluate(model, batches, head_ids)
    finally:
        model.train(was_training)


def _evaluate(model: DenseLlama, batches: list[Batch], head_ids: torch.Tensor) -> EvalStats:
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


class Best:
    """The held-out best weights so far: with little data the draft overfits, so the exported
    draft is the evaluation with the highest top-1 agreement (lower KL breaks ties)."""

    def __init__(self) -> None:
        self.stats: EvalStats | None = None
        self.step = 0
        self.weights: dict[str, torch.Tensor] = {}

    def offer(self, model: DenseLlama, stats: EvalStats, step: int) -> None:
        if self.stats is None or (stats.top1, -stats.kl) > (self.stats.top1, -self.stats.kl):
            self.stats, self.step = stats, step
            self.weights = {n: p.detach().clone() for n, p in _trainable(model).items()}

    def restore(self, model: DenseLlama) -> None:
        params = _trainable(model)
        with torch.no_grad():
            for name, tensor in self.weights.items():
                params[name].copy_(tensor)

    def to_dict(self) -> dict[str, object]:
        return {"stats": None if self.stats is None else asdict(self.stats), "step": self.step,
                "weights": self.weights}

    @classmethod
    def from_dict(cls, raw: dict) -> Best:
        best = cls()
        best.stats = None if raw["stats"] is None else EvalStats(**raw["stats"])
        best.step, best.weights = raw["step"], raw["weights"]
        return best


class Checkpoint:
    """``checkpoint.pt``: trainable weights, optimiser, schedule and data-order state, and the
    best weights so far.

    Written to a temp file and renamed; read back with ``weights_only=True`` (tensors and plain
    values only, nothing that can run code)."""

    def __init__(self, path: Path, identity: dict[str, object]) -> None:
        self.path = path
        self.identity = identity  # settings a resumed run must share (layers, vocabulary, ...)

    def save(
        self, model: DenseLlama, opt: torch.optim.Optimizer, state: dict[str, object], best: Best
    ) -> None:
        payload = {
            "identity": self.identity,
            "weights": {n: p.detach() for n, p in _trainable(model).items()},
            "optimizer": opt.state_dict(),
            "state": state,
            "best": best.to_dict(),
        }
        tmp = self.path.with_suffix(".tmp")
        torch.save(payload, tmp)
        tmp.replace(self.path)

    def load(self, model: DenseLlama, opt: torch.optim.Optimizer) -> tuple[dict, Best]:
        payload = torch.load(self.path, map_location="cpu", weights_only=True)
        if payload["identity"] != self.identity:
            raise ValueError(
                f"{self.path} was written by a run with different settings; use another --out "
                "or drop --resume"
            )
        params = _trainable(model)
        with torch.no_grad():
            for name, tensor in payload["weights"].items():
                params[name].copy_(tensor)
        opt.load_state_dict(payload["optimizer"])
        return payload["state"], Best.from_dict(payload["best"])


def _train_step(
    model: DenseLlama, opt: torch.optim.Optimizer, batch: Batch, lr: float, clip: float,
    dtype: torch.dtype | None = None, argmax_weight: float = 0.0,
) -> float:
    """One AdamW step; ``dtype`` (``TRAIN_DTYPES``): the forward's matmuls autocast to it (their
    backward follows), None: float32 throughout; ``argmax_weight``: ``TrainConfig``'s."""
    for group in opt.param_groups:
        group["lr"] = lr
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss, _ = _step_loss(model, batch, argmax_weight)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
    opt.step()
    return float(loss.detach())


@torch.random.fork_rng(devices=[])  # the CPU generator (training runs on the CPU), restored after
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
    """Train ``model``; on return it holds the best held-out weights seen. Returns losses and
    held-out agreement before training and of the weights kept. Dropout draws from torch's
    generator seeded from ``cfg.seed`` (and the step a resumed run starts at), inside a fork
    of the caller's RNG state: the same seed trains the same draft, whatever ran before."""
    if cfg.train_dtype not in TRAIN_DTYPES:
        raise ValueError(f"train_dtype must be one of {', '.join(TRAIN_DTYPES)}, not {cfg.train_dtype!r}")
    if not (math.isfinite(cfg.argmax_weight) and cfg.argmax_weight >= 0):
        raise ValueError(f"argmax_weight must be a number >= 0, not {cfg.argmax_weight}")
    tuner = ThreadTuner(cfg.max_threads)
    model.set_dropout(cfg.dropout)
    model.train()
    opt = torch.optim.AdamW(list(_trainable(model).values()), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    heldout = eval_batches(data, heldout_seqs, head_map, cfg)
    state: dict = {"step": 0, "elapsed": 0.0, "epoch": 0, "pos": 0, "tokens": 0, "history": []}
    best = Best()
    if resume and checkpoint.path.is_file():
        state, best = checkpoint.load(model, opt)
        initial = EvalStats(**state["initial_eval"])
    else:
        initial = evaluate(model, heldout, head_ids)
        state["initial_eval"] = asdict(initial)
        best.offer(model, initial, 0)
    last_eval = initial
    torch.manual_seed(cfg.seed * 1_000_003 + state["step"])
    bar = tqdm(total=cfg.max_steps, initial=state["step"], desc="distil draft", unit="step",
               dynamic_ncols=True)
    ema: float | None = None
    plan = plan_batches(data, train_seqs, cfg.batch_tokens, random.Random(cfg.seed + state["epoch"]))
    start = time.monotonic() - state["elapsed"]
    last_eval_t = last_ckpt_t = time.monotonic()
    while True:
        progress = max(state["step"] / cfg.max_steps, (time.monotonic() - start) / cfg.time_budget_s)
        if progress >= 1.0:
            break
        if state["pos"] >= len(plan):
            state["epoch"], state["pos"] = state["epoch"] + 1, 0
            plan = plan_batches(data, train_seqs, cfg.batch_tokens, random.Random(cfg.seed + state["epoch"]))
        batch = make_batch(data, plan[state["pos"]], head_map)
        lr = cfg.lr * _lr_factor(state["step"], progress, cfg)
        value = _train_step(model, opt, batch, lr, cfg.grad_clip, TRAIN_DTYPES[cfg.train_dtype], cfg.argmax_weight)
        state.setdefault("first_loss", value)
        ema = value if ema is None else 0.9 * ema + 0.1 * value
        state["step"] += 1
        state["pos"] += 1
        state["tokens"] += batch.num_targets
        state["elapsed"] = time.monotonic() - start
        state["last_loss"] = value
        tuner.maybe_retune()
        if time.monotonic() - last_eval_t > cfg.eval_every_s:
            last_eval = evaluate(model, heldout, head_ids)
            best.offer(model, last_eval, state["step"])
            state["history"].append({"step": state["step"], "loss": ema, **asdict(last_eval)})
            last_eval_t = time.monotonic()
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", top1=f"{last_eval.top1:.3f}",
                        best=f"{best.stats.top1:.3f}" if best.stats else "-", lr=f"{lr:.1e}",
                        ep=state["epoch"], thr=tuner.threads)
        if time.monotonic() - last_ckpt_t > cfg.checkpoint_every_s:
            checkpoint.save(model, opt, state, best)
            last_ckpt_t = time.monotonic()
    bar.close()
    final = evaluate(model, heldout, head_ids)
    best.offer(model, final, state["step"])
    state["history"].append({"step": state["step"], "loss": ema or 0.0, **asdict(final)})
    keep_last = cfg.keep == "last"
    state["kept_step"] = state["step"] if keep_last else best.step
    checkpoint.save(model, opt, state, best)
    if not keep_last:
        best.restore(model)
    return TrainResult(
        steps=state["step"],
        train_seconds=state["elapsed"],
        train_tokens=state["tokens"],
        first_loss=state.get("first_loss", float("nan")),
        last_loss=state.get("last_loss", float("nan")),
        initial_eval=initial,
        final_eval=final if keep_last else (best.stats or final),
        kept_step=state["kept_step"],
        history=state["history"],
    )
