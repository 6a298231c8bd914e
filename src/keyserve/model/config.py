"""A typed view of a Hugging Face ``config.json`` for the Llama family we implement.

Reading the raw dict ourselves (instead of holding a ``transformers`` config object) keeps the
model independent of transformers' config classes and makes unsupported settings fail loudly
at load time rather than silently computing something else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from keyserve.model.weights import SHARD_INDEX, safetensors_files

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

_DTYPE_NAMES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings, normalised from ``rope_parameters`` / ``rope_scaling``."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    # yarn
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder, the loader and the KV-cache sizing need from ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None = None
    # Per layer: True where the layer attends only to the last ``sliding_window`` tokens.
    sliding_layers: tuple[bool, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: torch.dtype | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The window of one layer, or None for a full-attention layer."""
        if self.sliding_window is None:
            return None
        return self.sliding_window if self.sliding_layers[layer_idx] else None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        return _parse(cfg)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Parse a Hugging Face ``config.json``; anything wrong in it is a ValueError naming
        the file and the field."""
        with open(path, encoding="utf-8") as f:
            try:
                cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{path} must hold a JSON object, not {type(cfg).__name__}")
        try:
            tie_default = False
            if cfg.get("tie_word_embeddings") is None:
                tie_default = _checkpoint_lacks_lm_head(Path(path).parent)
            return _parse(cfg, tie_default)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e


def _positive(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """``cfg[key]`` as a positive int (``default`` when absent or null); a ValueError naming the
    field otherwise (a raw KeyError or a division by zero further on names nothing)."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"{key!r} is missing (a Llama-family config needs it)")
        if default < 1:
            raise ValueError(f"{key!r} is missing and its default ({default}) is not positive")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise ValueError(f"{key!r} must be a positive integer, not {value!r}")
    return int(value)


def _checkpoint_lacks_lm_head(directory: Path) -> bool:
    """For a config.json that does not say whether the LM head is tied: True when the
    directory's safetensors checkpoint holds no ``lm_head.weight`` (the head can only be the
    embedding), False when it holds one or cannot be read (transformers' default, untied)."""
    try:
        index = directory / SHARD_INDEX
        if index.is_file():
            with open(index, encoding="utf-8") as f:
                names = set(json.load(f)["weight_map"])
        else:
            names = set()
            for file in safetensors_files(directory):
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    names.update(f.keys())
    except Exception:  # unreadable here: the weight loader names the problem
        return False
    return bool(names) and "lm_head.weight" not in names


def _refuse_quantized(cfg: dict[str, Any]) -> None:
    """A quantized checkpoint (GPTQ, AWQ, bitsandbytes, fp8, compressed-tensors) stores packed
    integers or fp8 tensors with scales: keyserve's float model would refuse it one tensor at a
    time (``qweight``, ``weight_scale``: "unexpected weight") or, where names and shapes happen
    to fit, load it as garbage. Refused whole, naming the method."""
    for key in ("quantization_config", "compression_config"):
        q = cfg.get(key)
        if q:
            method = q.get("quant_method", "unknown") if isinstance(q, dict) else "unknown"
            raise ValueError(
                f"quantized checkpoint ({key} quant_method {method!r}) is not supported: keyserve "
                "loads float16 / bfloat16 / float32 weights (dequantize the checkpoint first)"
            )


def _parse(cfg: dict[str, Any], tie_default: bool = False) -> ModelConfig:
    """``tie_default``: whether the LM head is tied when the config does not say (transformers'
    Llama, Mistral and Qwen2 configs default to untied)."""
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r} (architectures {archs}); keyserve implements "
            f"the Llama family: model_type in {SUPPORTED_MODEL_TYPES}"
        )
    bad = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    if bad:
        raise ValueError(f"unsupported architecture {bad[0]!r}; supported: {SUPPORTED_ARCHITECTURES}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}: the SwiGLU MLP needs 'silu'")
    if cfg.get("pretraining_tp", 1) not in (1, None):
        raise ValueError("pretraining_tp > 1 (split-matmul Llama 2 variant) is not supported")
    _refuse_quantized(cfg)

    hidden = _positive(cfg, "hidden_size")
    heads = _positive(cfg, "num_attention_heads")
    kv_heads = _positive(cfg, "num_key_value_heads", heads)
    head_dim = _positive(cfg, "head_dim", hidden // heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    num_layers = _positive(cfg, "num_hidden_layers")
    max_pos = _positive(cfg, "max_position_embeddings", 2048)

    attention_bias = bool(cfg.get("attention_bias", False))
    qkv_bias, o_bias = attention_bias, attention_bias
    if model_type == "qwen2":  # Qwen2 always has q/k/v biases and never an o_proj bias
        qkv_bias, o_bias = True, False

    window, sliding_layers = _sliding_window(cfg, model_type, num_layers)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    dtype_name = cfg.get("dtype") or cfg.get("torch_dtype")
    return ModelConfig(
        model_type=model_type,
        vocab_size=_positive(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_positive(cfg, "intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(cfg, max_pos),
        max_position_embeddings=max_pos,
        tie_word_embeddings=(
            tie_default if cfg.get("tie_word_embeddings") is None else bool(cfg["tie_word_embeddings"])
        ),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=window,
        sliding_layers=sliding_layers,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=_DTYPE_NAMES.get(str(dtype_name)) if dtype_name else None,
        raw=dict(cfg),
    )


def _sliding_window(
    cfg: dict[str, Any], model_type: str, num_layers: int
) -> tuple[int | None, tuple[bool, ...]]:
    """The window size and which layers use it, following each family's config convention."""
    window = cfg.get("sliding_window")
    if model_type == "llama" or window is None:
        return None, (False,) * num_layers
    if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
        return None, (False,) * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"unsupported layer_types {sorted(unknown)}")
        layers = tuple(t == "sliding_attention" for t in layer_types)
    elif model_type == "qwen2":
        first = int(cfg.get("max_window_layers", num_layers))
        layers = tuple(i >= first for i in range(num_layers))
    else:  # mistral: every layer
        layers = (True,) * num_layers
    if not any(layers):
        return None, layers
    return int(window), layers


def _check_rope_spellings_agree(new: Any, old: Any) -> None:
    """A config with both ``rope_parameters`` and ``rope_scaling`` (e.g. scaling added by hand to
    a transformers-5 config, as model cards instruct) is ambiguous: transformers follows
    ``rope_scaling``, so silently reading ``rope_parameters`` would compute other logits."""
    if not (isinstance(new, dict) and isinstance(old, dict) and new and old):
        return
    if "full_attention" in new or "sliding_attention" in new:
        return  # refused below

    def kind(d: dict[str, Any]) -> Any:
        return d.get("rope_type", d.get("type", "default"))

    differ = [k for k, v in old.items() if k not in ("type", "rope_type") and new.get(k) != v]
    if kind(new) != kind(old):
        differ = [f"rope type {kind(new)!r} vs {kind(old)!r}", *differ]
    if differ:
        raise ValueError(
            f"rope_parameters {new} and rope_scaling {old} disagree ({', '.join(differ)}); keep "
            "one of them (transformers follows rope_scaling, keyserve will not guess)"
        )


def parse_rope(cfg: dict[str, Any], max_position_embeddings: int) -> RopeConfig:
    """Normalise the three spellings transformers has used over time.

    transformers 5 writes ``rope_parameters: {rope_type, rope_theta, ...}``; 4.x wrote a top-level
    ``rope_theta`` plus ``rope_scaling: {rope_type|type, factor, ...}`` (or null).
    """
    _check_rope_spellings_agree(cfg.get("rope_parameters"), cfg.get("rope_scaling"))
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "full_attention" in params or "sliding_attention" in params:
        raise ValueError("per-layer-type rope_parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor {partial} is not supported")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    orig = cfg.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings"
    )
    if rope_type in ("llama3", "yarn") and orig is None:
        orig = max_position_embeddings

    def opt(key: str) -> float | None:
        value = params.get(key)
        return None if value is None else float(value)

    rope = RopeConfig(
        rope_type=rope_type,
        theta=theta,
        factor=opt("factor"),
        low_freq_factor=opt("low_freq_factor"),
        high_freq_factor=opt("high_freq_factor"),
        original_max_position_embeddings=None if orig is None else int(orig),
        attention_factor=opt("attention_factor"),
        beta_fast=opt("beta_fast"),
        beta_slow=opt("beta_slow"),
        mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )
    needs = {
        "linear": ("factor",),
        "dynamic": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    }.get(rope_type, ())
    missing = [k for k in needs if getattr(rope, k) is None]
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs {missing} in rope_parameters")
    return rope
