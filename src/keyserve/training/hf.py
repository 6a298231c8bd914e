"""A keyserve draft as a ``transformers`` model, for comparing with transformers' assisted
generation (``target.generate(..., assistant_model=draft)``) on the very same weights.

The draft's embedding module is the target's (shared, as keyserve does) and its LM head is
replaced by ``PrunedLMHead``, which returns full-vocabulary logits with ``-inf`` outside the
draft's tokens -- the same distribution keyserve's ``PrunedHeadLlama`` produces.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from keyserve.model.draft_model import DRAFT_META_FILE, DraftMeta, resolve_draft_dir


class PrunedLMHead(nn.Module):
    """``[..., hidden] -> [..., vocab]`` logits, ``-inf`` outside ``token_ids``."""

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()  # weight: [N, hidden]; token_ids: [N] int64
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("token_ids", token_ids)
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab]
        sub = F.linear(hidden, self.weight)
        out = sub.new_full((*hidden.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.token_ids, sub)


def draft_for_transformers(draft: str | Path, target: Any) -> Any:
    """A ``transformers.LlamaForCausalLM`` for the keyserve draft at ``draft``, sharing
    ``target``'s (a transformers model's) input embeddings; same dtype and device as it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = resolve_draft_dir(draft)
    meta = DraftMeta.read(directory / DRAFT_META_FILE)
    with open(directory / "config.json", encoding="utf-8") as f:
        raw = json.load(f)
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("dtype", "torch_dtype")})
    embed = target.get_input_embeddings()
    if embed.weight.shape != (config.vocab_size, config.hidden_size):
        raise ValueError(
            f"target embeddings {tuple(embed.weight.shape)} do not match the draft's "
            f"(vocab {config.vocab_size}, hidden {config.hidden_size})"
        )
    dtype, device = embed.weight.dtype, embed.weight.device
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    tensors = load_file(str(directory / "model.safetensors"))
    head = tensors.pop("lm_head.weight")
    model.model.embed_tokens = embed
    model.lm_head = PrunedLMHead(
        head.to(device, dtype), torch.tensor(meta.lm_head_token_ids, device=device), config.vocab_size
    )
    state = {k: v.to(device, dtype) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    left = [m for m in missing if not m.startswith(("model.embed_tokens", "lm_head"))]
    if left or unexpected:
        raise ValueError(f"draft weights do not fit the model: missing {left}, unexpected {unexpected}")
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.eval()
