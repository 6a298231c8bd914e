"""Keyformer's two step-time inputs: the temperature schedule and the Gumbel noise's seed.

Keyformer scores tokens by a Gumbel-perturbed softmax of the attention logits at temperature
tau (docs/algorithms.md §2); the kernels compute those scores in the attention pass
(``score_mode="gumbel"``), the tracker accumulates them and evicts by them. What the step adds
is tau per attention row (1 in the prompt phase, then rising linearly from ``tau_init`` to
``tau_end`` over ``max_tokens``: ``core.kv_policy.keyformer_tau``) and where the noise comes
from (seeded per request when every Keyformer request in the step has a seed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from keyserve.core.kv_policy import KVBudget, KVPolicy, keyformer_tau
from keyserve.engine.step_input import SeqInfo, StepItem


def tau(kv_budget: KVBudget, seq_infos: dict[int, SeqInfo], item: StepItem, decoding: bool, offset: int = 0) -> float:
    """Keyformer's temperature for one attention row of ``item``: 1 in the prompt phase (and
    for every other policy), then the linear schedule; ``offset`` is the row's distance from
    the item's first query (verification rows)."""
    if not decoding or kv_budget.policy is not KVPolicy.KEYFORMER:
        return 1.0
    p = seq_infos[item.seq_id].params
    step = max(0, item.num_output_tokens - 1 + offset)
    return keyformer_tau(step, p.max_tokens, p.tau_init, p.tau_end)


def noise(items: list[StepItem], seq_infos: dict[int, SeqInfo]) -> contextlib.AbstractContextManager[object]:
    """Where the forward's Gumbel noise comes from. It is drawn from torch's generator inside
    the attention kernels. When every Keyformer sequence in the step has a seed, the forward
    draws it from a generator seeded by (seed, sample, position) of those sequences, so a
    seeded request (alone, or in the same batch) evicts the same tokens every time; the global
    generator is left where it was. Otherwise the noise is fresh."""
    keys = []
    for item in items:
        if item.budget is None or item.budget.policy is not KVPolicy.KEYFORMER:
            continue
        info = seq_infos.get(item.seq_id)
        if info is None or info.params.seed is None:
            return contextlib.nullcontext()
        keys.append((info.params.seed, info.sample_index, item.start))
    if not keys:
        return contextlib.nullcontext()
    seed = 0x9E3779B97F4A7C15
    for request_seed, sample_index, start in keys:
        for part in (request_seed, sample_index, start):
            seed = ((seed ^ part) * 0x100000001B3) & 0x7FFFFFFFFFFFFFFF
    return _seeded_cpu_generator(seed)


@contextlib.contextmanager
def _seeded_cpu_generator(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
