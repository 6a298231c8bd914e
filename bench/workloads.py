"""Reproducible benchmark workloads built from real English text available offline."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pydoc_data.topics


def documents(min_chars: int = 0) -> list[tuple[str, str]]:
    """Sections of the Python language reference (name, text), longest first."""
    topics = sorted(pydoc_data.topics.topics.items(), key=lambda kv: -len(kv[1]))
    return [(name, text) for name, text in topics if len(text) >= min_chars]


@dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


def mixed_requests(
    tokenizer, num: int = 64, prompt_range=(50, 1000), output_range=(16, 256), seed: int = 0
) -> list[Request]:
    """``num`` prompts of uniformly random length cut from the reference text, each asking for a
    uniformly random number of output tokens."""
    rng = random.Random(seed)
    corpus = tokenizer.encode("\n\n".join(text for _, text in documents()))
    out = []
    for _ in range(num):
        n = rng.randint(*prompt_range)
        start = rng.randrange(0, len(corpus) - n)
        out.append(Request(corpus[start : start + n], rng.randint(*output_range)))
    return out


def step_until_decoding(engine, num_seqs: int) -> None:  # noqa: ANN001 - an LLMEngine
    """Step ``engine`` until a step is ``num_seqs`` decode rows (every request past its prompt)."""
    while True:
        engine.step()
        step = engine._running_step
        if step is not None and len(step.items) == num_seqs and all(it.num_new_tokens == 1 for it in step.items):
            return
