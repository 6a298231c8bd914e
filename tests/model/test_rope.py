"""RoPE tables and rotation are bit-identical to transformers for the configs we serve."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from keyserve.model.config import ModelConfig
from keyserve.model.rope import RotaryEmbedding, apply_rotary

SMOLLM2 = dict(  # SmolLM2-135M-Instruct as transformers 5.23 writes it
    hidden_size=576,
    num_attention_heads=9,
    head_dim=64,
    max_position_embeddings=8192,
    rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
)
LLAMA31_8B = dict(  # Meta-Llama-3.1-8B, in the transformers-4 spelling
    hidden_size=4096,
    num_attention_heads=32,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rope_scaling={
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
)
LLAMA32_1B = dict(
    hidden_size=2048,
    num_attention_heads=32,
    head_dim=64,
    max_position_embeddings=131072,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
SMALL = dict(hidden_size=256, num_attention_heads=4, max_position_embeddings=4096)
CASES: dict[str, dict[str, Any]] = {
    "smollm2": SMOLLM2,
    "llama3.1-8b": LLAMA31_8B,
    "llama3.2-1b": LLAMA32_1B,
    "linear-legacy-type-key": {**SMALL, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "dynamic": {**SMALL, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
    "yarn": {
        **SMALL,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    },
    "yarn-mscale": {
        **SMALL,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16.0,
            "truncate": False,
        },
    },
}


def _positions(max_pos: int) -> torch.Tensor:
    """Every position of a short context, plus a spread up to the end of a long one."""
    gen = torch.Generator().manual_seed(0)
    dense = torch.arange(min(max_pos, 2048))
    sparse = torch.randint(0, max_pos, (2048,), generator=gen)
    return torch.cat([dense, sparse, torch.tensor([max_pos - 1])])


@pytest.mark.parametrize("name", sorted(CASES))
def test_cos_sin_bit_identical(name: str) -> None:
    hf_config = transformers.LlamaConfig(**CASES[name])
    ours_config = ModelConfig.from_dict(
        {**hf_config.to_dict(), "vocab_size": 8, "intermediate_size": 8, "num_hidden_layers": 1}
    )
    rope = RotaryEmbedding(ours_config.rope, ours_config.head_dim, ours_config.max_position_embeddings)
    pos = _positions(ours_config.max_position_embeddings)
    hf_rope = LlamaRotaryEmbedding(hf_config)
    x = torch.zeros(1, dtype=torch.float32)
    cos_hf, sin_hf = hf_rope(x, pos[None])
    cos, sin = rope(pos, torch.float32)
    half = ours_config.head_dim // 2
    assert torch.equal(cos[:, 0], cos_hf[0])
    assert torch.equal(sin[:, 0, half:], sin_hf[0, :, half:])
    assert torch.equal(sin[:, 0, :half], -sin_hf[0, :, :half])  # stored signed: [-s, s]
    assert rope.attention_scaling == hf_rope.attention_scaling


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_bit_identical(dtype: torch.dtype) -> None:
    hf_config = transformers.LlamaConfig(**LLAMA32_1B)
    cfg = ModelConfig.from_dict(
        {**hf_config.to_dict(), "vocab_size": 8, "intermediate_size": 8, "num_hidden_layers": 1}
    )
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, 4096)
    pos = torch.randint(0, 4096, (37,), generator=torch.Generator().manual_seed(1))
    q = torch.randn(37, 6, cfg.head_dim).to(dtype)
    k = torch.randn(37, 2, cfg.head_dim).to(dtype)
    cos_hf, sin_hf = LlamaRotaryEmbedding(hf_config)(q, pos[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_hf, sin_hf)
    cos, sin = rope(pos, dtype)
    assert torch.equal(apply_rotary(q, cos, sin), q_hf[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, sin), k_hf[0].transpose(0, 1))
