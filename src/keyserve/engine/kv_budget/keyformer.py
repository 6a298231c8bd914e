"""Keyformer's two step-time inputs: the temperature schedule and the Gumbel noise's keys.

Keyformer scores tokens by a Gumbel-perturbed softmax of the attention logits at temperature
tau (docs/algorithms.md §2); the kernels compute those scores in the attention pass
(``score_mode="gumbel"``), the tracker accumulates them and evicts by them. What the step adds
is tau per attention row (1 in the prompt phase, then rising linearly from ``tau_init`` to
``tau_end`` over ``max_tokens``: ``core.kv_policy.keyformer_tau``) and each row's noise key
(the request's seed and the query's position: ``noise_keys``, the hash in ``kernels/noise.py``).
"""

from __future__ import annotations

import torch

from keyserve.core.kv_policy import KVBudget, KVPolicy, keyformer_tau
from keyserve.engine.step_input import SeqInfo, StepItem
from keyserve.kernels import noise


def tau(kv_budget: KVBudget, seq_infos: dict[int, SeqInfo], item: StepItem, decoding: bool, offset: int = 0) -> float:
    """Keyformer's temperature for one attention row of ``item``: 1 in the prompt phase (and
    for every other policy), then the linear schedule; ``offset`` is the row's distance from
    the item's first query (verification rows)."""
    if not decoding or kv_budget.policy is not KVPolicy.KEYFORMER:
        return 1.0
    p = seq_infos[item.seq_id].params
    step = max(0, item.num_output_tokens - 1 + offset)
    return keyformer_tau(step, p.max_tokens, p.tau_init, p.tau_end)


def noise_keys(
    rows: list[tuple[int, int, int]],  # (attention row, seq_id, query position) of Keyformer rows
    num_rows: int,
    seq_infos: dict[int, SeqInfo],
    generator: torch.Generator,  # seeds of the rows whose request has none
    device: torch.device,
) -> torch.Tensor:  # [num_rows, 2] int64: (noise seed, position); other rows (0, 0)
    """The attention metadata's ``noise_keys``: per Keyformer row its request's 32-bit noise
    seed (``kernels.noise.request_seed`` of its seed and sample index) and the position of its
    (first) query token. The kernels draw each logit's noise from that key, the layer, the head
    and the slot, so a seeded request evicts the same tokens whatever it is batched with. A
    request without a seed gets a fresh seed from ``generator`` every step."""
    keys = torch.zeros(num_rows, 2, dtype=torch.int64)
    unseeded: list[int] = []
    for row, seq_id, position in rows:
        info = seq_infos.get(seq_id)
        keys[row, 1] = position
        if info is None or info.params.seed is None:
            unseeded.append(row)
        else:
            keys[row, 0] = noise.request_seed(info.params.seed, info.sample_index)
    if unseeded:
        keys[unseeded, 0] = torch.randint(0, 1 << 32, (len(unseeded),), dtype=torch.int64,
                                          generator=generator)
    return keys.to(device)
