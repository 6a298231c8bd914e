"""Let the target answer the prompt set, recording its top-k distribution before every token.

Why not ``keyserve.LLM``: the engine returns tokens, not the logits behind them, and the
distillation loss needs exactly those; recomputing them afterwards would cost a second full
target pass over every token. This loop keeps a fixed number of sequence slots busy (a finished
slot is refilled with the next prompt, as continuous batching does), decodes all slots in one
batched forward per step over a contiguous KV cache, and saves what it has every minute.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from keyserve.training.dense import DenseKVCache, DenseLlama
from keyserve.training.records import Answer
from keyserve.training.threads import ThreadTuner


@dataclass
class GenerationJob:
    """What to generate: prompt ``i`` is answered at ``temperatures[i]`` (0 = greedy)."""

    prompts: list[list[int]]
    temperatures: list[float]
    indices: list[int]  # the prompt index each entry is recorded under
    max_new_tokens: int
    stop_ids: set[int]
    top_k: int = 32
    slots: int = 48
    seed: int = 0


@dataclass
class _Slot:
    index: int = -1  # position in the job, -1 = idle
    length: int = 0  # tokens in the KV cache
    prompt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    ids: list[torch.Tensor] = field(default_factory=list)  # each [k] int32
    logprobs: list[torch.Tensor] = field(default_factory=list)  # each [k] float16


def _answer(job: GenerationJob, slot: _Slot) -> Answer:
    return Answer(
        job.indices[slot.index],
        slot.prompt,
        slot.tokens,
        torch.stack(slot.ids),
        torch.stack(slot.logprobs),
    )


class _Sampler:
    """Records the top-k of ``log_softmax(logits)`` and samples at each row's temperature."""

    def __init__(self, top_k: int, seed: int) -> None:
        self.top_k = top_k
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # [B, vocab] float32
        temps: torch.Tensor,  # [B] float32, 0 = greedy
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # tokens [B], ids [B, k], lps [B, k]
        logprobs = torch.log_softmax(logits, dim=-1)
        top_lp, top_ids = logprobs.topk(min(self.top_k, logits.shape[-1]), dim=-1)
        scaled = logits / temps.clamp_min(1e-6)[:, None]
        sampled = torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=self.gen)[:, 0]
        tokens = torch.where(temps > 0, sampled, top_ids[:, 0])
        return tokens, top_ids.to(torch.int32), top_lp.to(torch.float16)


@torch.inference_mode()
def generate_answers(
    target: DenseLlama,
    job: GenerationJob,
    deadline: float,
    on_save: Callable[[list[Answer]], None],
    save_every_s: float = 60.0,
    tuner: ThreadTuner | None = None,
) -> int:
    """Answer every prompt of ``job`` (or as many as fit before ``deadline``, a
    ``time.monotonic()`` value; unfinished answers are kept, they are valid data). Finished
    answers go to ``on_save`` about every ``save_every_s`` seconds; returns tokens generated."""
    n = len(job.prompts)
    max_len = max((len(p) for p in job.prompts), default=1) + job.max_new_tokens
    cache = DenseKVCache.allocate(target.config, len(target.layers), job.slots, max_len, torch.float32)
    slots = [_Slot() for _ in range(job.slots)]
    sampler = _Sampler(job.top_k, job.seed)
    pending: list[Answer] = []
    next_prompt, generated, last_save = 0, 0, time.monotonic()
    bar = tqdm(total=n, desc="target answers", unit="prompt", dynamic_ncols=True)
    start = time.monotonic()

    def finish(slot: _Slot) -> None:
        pending.append(_answer(job, slot))
        slot.index = -1
        bar.update(1)

    while True:
        out_of_time = time.monotonic() > deadline
        idle = [i for i, s in enumerate(slots) if s.index < 0]
        if idle and next_prompt < n and not out_of_time:
            fresh = idle[: n - next_prompt]
            for i in fresh:
                slots[i] = _Slot(index=next_prompt, prompt=job.prompts[next_prompt])
                next_prompt += 1
            _prefill(target, cache, [slots[i] for i in fresh], fresh, job, sampler)
        active = [i for i, s in enumerate(slots) if s.index >= 0]
        for i in active:
            if _done(slots[i], job, max_len):
                finish(slots[i])
        active = [i for i, s in enumerate(slots) if s.index >= 0]
        if out_of_time or (not active and next_prompt >= n):
            for i in active:
                finish(slots[i])
            break
        if next_prompt < n and len(active) < job.slots:
            continue  # refill the finished slots before decoding
        if tuner is not None:
            tuner.maybe_retune()
        generated += _decode(target, cache, [slots[i] for i in active], active, job, sampler)
        bar.set_postfix(tok_s=f"{generated / max(time.monotonic() - start, 1e-9):.0f}")
        if pending and time.monotonic() - last_save > save_every_s:
            on_save(pending)
            pending, last_save = [], time.monotonic()
    bar.close()
    if pending:
        on_save(pending)
    return generated


def _done(slot: _Slot, job: GenerationJob, max_len: int) -> bool:
    if not slot.tokens:
        return False
    return (
        slot.tokens[-1] in job.stop_ids
        or len(slot.tokens) >= job.max_new_tokens
        or slot.length + 1 >= max_len
    )


def _record(
    slots: Sequence[_Slot], tokens: torch.Tensor, ids: torch.Tensor, lps: torch.Tensor
) -> None:
    for r, slot in enumerate(slots):
        slot.tokens.append(int(tokens[r]))
        slot.ids.append(ids[r])
        slot.logprobs.append(lps[r])


def _temps(job: GenerationJob, slots: Sequence[_Slot]) -> torch.Tensor:  # [B] float32
    return torch.tensor([job.temperatures[s.index] for s in slots], dtype=torch.float32)


def _prefill(
    target: DenseLlama,
    cache: DenseKVCache,
    slots: Sequence[_Slot],
    rows: list[int],
    job: GenerationJob,
    sampler: _Sampler,
) -> None:
    """Run the new prompts as one right-padded batch and sample each one's first token."""
    lengths = [len(s.prompt) for s in slots]
    width = max(lengths)
    ids = torch.zeros(len(slots), width, dtype=torch.int64)
    for r, s in enumerate(slots):
        ids[r, : len(s.prompt)] = torch.tensor(s.prompt)
    positions = torch.arange(width).expand(len(slots), width)
    hidden = target(ids, positions, cache, torch.tensor(rows))  # [R, width, hidden]
    last = hidden[torch.arange(len(slots)), torch.tensor(lengths) - 1]  # [R, hidden]
    tokens, top_ids, lps = sampler(target.logits(last), _temps(job, slots))
    for s, n in zip(slots, lengths):
        s.length = n
    _record(slots, tokens, top_ids, lps)


def _decode(
    target: DenseLlama,
    cache: DenseKVCache,
    slots: Sequence[_Slot],
    rows: list[int],
    job: GenerationJob,
    sampler: _Sampler,
) -> int:
    """One batched step: feed every slot's last token, sample the next; returns tokens made."""
    ids = torch.tensor([[s.tokens[-1]] for s in slots], dtype=torch.int64)
    positions = torch.tensor([[s.length] for s in slots], dtype=torch.int64)
    hidden = target(ids, positions, cache, torch.tensor(rows))[:, 0]  # [B, hidden]
    tokens, top_ids, lps = sampler(target.logits(hidden), _temps(job, slots))
    for s in slots:
        s.length += 1
    _record(slots, tokens, top_ids, lps)
    return len(slots)
