"""Logits of a serving model at every position of a fixed token sequence, without the engine.

The acceptance tool needs the draft's and the target's whole next-token distributions along
a text, which the engine never returns. The plain-attention ``DenseLlama`` computes the hidden
states in one causal forward over the serving model's own (shared, frozen) weights, and the
serving model's ``compute_logits`` turns them into logits -- so a draft's pruned LM head gives
full-vocabulary logits with ``-inf`` outside its tokens, exactly as in serving.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from keyserve.model.llama import LlamaForCausalLM
from keyserve.training.dense import DenseLlama


@torch.inference_mode()
def teacher_forced_logits(
    model: LlamaForCausalLM, tokens: Sequence[int]
) -> torch.Tensor:  # [len(tokens), vocab] float32, row i predicts token i + 1
    """The logits after every prefix ``tokens[: i + 1]`` of one sequence."""
    dense = DenseLlama.from_serving(model)
    ids = torch.tensor([list(tokens)], dtype=torch.int64, device=dense.embed.device)  # [1, n]
    positions = torch.arange(ids.shape[1], device=ids.device)[None]  # [1, n]
    hidden = dense(ids, positions)[0]  # [n, hidden] float32
    return model.compute_logits(hidden.to(model.dtype))
