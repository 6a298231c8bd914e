"""config.json -> ModelConfig: the spellings transformers has used, and loud refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from keyserve.model.config import ModelConfig

BASE: dict[str, Any] = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
)


def test_stories260k_config(stories_path: str) -> None:
    c = ModelConfig.from_file(Path(stories_path) / "config.json")
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (8, 4, 8)
    assert c.tie_word_embeddings and c.rope.rope_type == "default" and c.rope_theta == 10000.0
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,) and c.torch_dtype == torch.float32
    assert c.sliding_window is None and c.layer_sliding_window(0) is None


def test_defaults() -> None:
    c = ModelConfig.from_dict(BASE)
    assert c.head_dim == 8 and c.num_key_value_heads == 8
    assert c.rope.rope_type == "default" and c.rope_theta == 10000.0
    assert not (c.qkv_bias or c.o_bias or c.mlp_bias)


def test_transformers4_rope_spelling() -> None:
    c = ModelConfig.from_dict(
        {
            **BASE,
            "rope_theta": 500000.0,
            "max_position_embeddings": 131072,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "eos_token_id": [128001, 128008, 128009],
        }
    )
    assert c.rope.rope_type == "llama3" and c.rope.theta == 500000.0 and c.rope.factor == 8.0
    assert c.rope.original_max_position_embeddings == 8192
    assert c.eos_token_ids == (128001, 128008, 128009) and c.eos_token_id == 128001


def test_legacy_type_key_and_null_scaling() -> None:
    assert ModelConfig.from_dict({**BASE, "rope_scaling": {"type": "linear", "factor": 4}}).rope.factor == 4.0
    assert ModelConfig.from_dict({**BASE, "rope_scaling": None}).rope.rope_type == "default"


def test_yarn_defaults_original_context_to_max_positions() -> None:
    c = ModelConfig.from_dict(
        {**BASE, "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}
    )
    assert c.rope.original_max_position_embeddings == 4096


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "unsupported model_type"),
        ({"architectures": ["GemmaForCausalLM"]}, "unsupported architecture"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "longrope"}}, "unsupported rope type"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"pretraining_tp": 2}, "pretraining_tp"),
        # quantized checkpoints: their tensors are packed integers or fp8 with scales, which a
        # float model would load as garbage (or refuse one tensor at a time, naming none of it)
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantized checkpoint.*gptq"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized checkpoint.*fp8"),
        ({"quantization_config": {"load_in_4bit": True}}, "quantized checkpoint.*unknown"),
        ({"compression_config": {"quant_method": "compressed-tensors"}}, "quantized checkpoint.*compressed-tensors"),
    ],
)
def test_unsupported_configs_raise(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**BASE, **overrides})


def test_an_empty_quantization_config_is_no_quantization() -> None:
    assert ModelConfig.from_dict({**BASE, "quantization_config": None}).hidden_size == BASE["hidden_size"]
    assert ModelConfig.from_dict({**BASE, "quantization_config": {}}).hidden_size == BASE["hidden_size"]


def test_sliding_window_layers() -> None:
    mistral = {**BASE, "model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    c = ModelConfig.from_dict({**mistral, "sliding_window": 4096})
    assert c.sliding_window == 4096 and c.sliding_layers == (True,) * 4
    assert ModelConfig.from_dict({**mistral, "sliding_window": None}).sliding_window is None
    # llama configs sometimes carry the key; Llama itself never uses it
    assert ModelConfig.from_dict({**BASE, "sliding_window": 128}).sliding_window is None

    qwen = {**BASE, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32}
    assert ModelConfig.from_dict(qwen).sliding_window is None  # use_sliding_window defaults off
    c = ModelConfig.from_dict({**qwen, "use_sliding_window": True, "max_window_layers": 2})
    assert c.sliding_layers == (False, False, True, True)
    assert c.layer_sliding_window(1) is None and c.layer_sliding_window(2) == 32
    types = ["full_attention", "sliding_attention"] * 2
    c = ModelConfig.from_dict({**qwen, "use_sliding_window": True, "layer_types": types})
    assert c.sliding_layers == (False, True, False, True)
    assert c.qkv_bias and not c.o_bias
