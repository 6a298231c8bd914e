"""Reference models for parity tests: random tiny transformers models and our copy of them."""

from __future__ import annotations

from typing import Any

import torch
import transformers

from keyserve.model.config import ModelConfig
from keyserve.model.llama import LlamaForCausalLM

TINY_LLAMA: dict[str, Any] = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,  # GQA, 4 query heads per kv head
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 50000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
)


def randomize(hf: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is sharp and norms matter (a stronger parity test
    than transformers' near-zero default init)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(noise * (0.5 / p.shape[-1] ** 0.5) if p.dim() == 2 else 0.1 * noise)


def tiny_hf(
    arch: str = "llama", seed: int = 0, **overrides: Any
) -> transformers.PreTrainedModel:
    """A random transformers model (eager attention, float32) of the given family."""
    kwargs = {**TINY_LLAMA, **overrides}
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    config = cls[0](**kwargs, attn_implementation="eager")
    torch.manual_seed(seed)
    hf = cls[1](config).eval()
    randomize(hf, seed)
    return hf


def ours_from_hf(
    hf: transformers.PreTrainedModel, dtype: torch.dtype = torch.float32, **kwargs: Any
) -> LlamaForCausalLM:
    """Our model with the same weights, built from the config dict transformers would save."""
    config = ModelConfig.from_dict(hf.config.to_dict())
    model = LlamaForCausalLM(config, dtype=dtype, **kwargs)
    model.load_weights(hf.state_dict().items())
    return model.eval()


@torch.no_grad()
def hf_logits(hf: transformers.PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float32 logits of one full causal forward (the oracle)."""
    return hf(torch.tensor([tokens])).logits[0].float()
