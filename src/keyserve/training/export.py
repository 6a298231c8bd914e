"""Writing a trained draft as a directory ``keyserve.model.draft_model.load_draft`` reads.

Files: ``config.json`` (the draft's Llama config: the target's, with fewer layers and an untied
head), ``model.safetensors`` (layers, final norm, the ``[N, hidden]`` pruned LM head; no
embeddings -- they are the target's) and ``keyserve_draft.json`` (head token ids, target,
tokenizer fingerprint, how it was trained). Every file is written to a temporary name and
renamed into place, the metadata last: until it exists the directory is not a usable draft.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from keyserve.model.config import ModelConfig
from keyserve.model.draft_model import DRAFT_META_FILE, DraftMeta
from keyserve.training.dense import DenseLlama

WEIGHTS_FILE = "model.safetensors"


def draft_config_dict(target: ModelConfig, num_layers: int, dtype: torch.dtype) -> dict[str, Any]:
    """The target's ``config.json`` with the draft's depth, an untied head and storage dtype."""
    raw = dict(target.raw)
    for key in ("layer_types", "quantization_config", "_name_or_path"):
        raw.pop(key, None)
    raw.update(
        num_hidden_layers=num_layers,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        dtype=str(dtype).removeprefix("torch."),
    )
    raw.pop("torch_dtype", None)
    return raw


def draft_tensors(model: DenseLlama, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Hugging Face names for the trainable tensors; fused q/k/v and gate/up are split."""
    c = model.config
    q_rows = c.num_attention_heads * c.head_dim
    kv_rows = c.num_key_value_heads * c.head_dim
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.qkv.detach().split([q_rows, kv_rows, kv_rows])
        gate, up = layer.gate_up.detach().chunk(2)
        out.update({
            p + "self_attn.q_proj.weight": q,
            p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": layer.o.detach(),
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": layer.down.detach(),
            p + "input_layernorm.weight": layer.input_layernorm.weight.detach(),
            p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight.detach(),
        })
    out["model.norm.weight"] = model.norm.weight.detach()
    out["lm_head.weight"] = model.head.detach()
    return {name: t.to(dtype).contiguous() for name, t in out.items()}


def import_draft(directory: Path) -> dict[str, Any]:
    """An exported draft read back in the shape of a run's ``checkpoint.pt`` (``identity`` with
    its layers and head ids, ``best.weights`` under ``DenseLlama``'s parameter names, float32), so
    ``distill-draft --init-from DIR`` trains on from a committed draft whose run directory is gone.
    The inverse of ``draft_tensors``: q/k/v and gate/up are fused again."""
    meta = json.loads((directory / DRAFT_META_FILE).read_text(encoding="utf-8"))
    layers = (meta.get("training") or {}).get("init_layers")
    if layers is None:
        raise ValueError(f"{directory}: its {DRAFT_META_FILE} does not record which target layers it started from")
    raw = {name: t.float() for name, t in load_file(str(directory / WEIGHTS_FILE)).items()}
    weights: dict[str, torch.Tensor] = {}
    for i in range(len(layers)):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        q = f"layers.{i}."
        weights[q + "qkv"] = torch.cat([raw[a + "q_proj.weight"], raw[a + "k_proj.weight"], raw[a + "v_proj.weight"]])
        weights[q + "o"] = raw[a + "o_proj.weight"]
        weights[q + "gate_up"] = torch.cat([raw[m + "gate_proj.weight"], raw[m + "up_proj.weight"]])
        weights[q + "down"] = raw[m + "down_proj.weight"]
        weights[q + "input_layernorm.weight"] = raw[p + "input_layernorm.weight"]
        weights[q + "post_attention_layernorm.weight"] = raw[p + "post_attention_layernorm.weight"]
    weights["norm.weight"] = raw["model.norm.weight"]
    weights["head"] = raw["lm_head.weight"]
    identity = {"layers": list(layers), "head_ids": list(meta["lm_head_token_ids"])}
    return {"identity": identity, "best": {"weights": weights}, "weights": weights}


def _write_atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    tmp.replace(path)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")

    _write_atomic(path, write)


def export_draft(
    model: DenseLlama,
    meta: DraftMeta,
    out_dir: Path,
    dtype: torch.dtype = torch.float16,
) -> list[Path]:
    """Write the draft into ``out_dir``; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = draft_config_dict(model.config, len(model.layers), dtype)
    tensors = draft_tensors(model, dtype)
    weights, cfg, meta_path = out_dir / WEIGHTS_FILE, out_dir / "config.json", out_dir / DRAFT_META_FILE
    meta_path.unlink(missing_ok=True)  # not a usable draft until the new metadata lands
    _write_atomic(weights, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    _write_json(cfg, config)
    meta_json = meta.to_json()
    ids = meta_json.pop("lm_head_token_ids")
    meta_json["lm_head_token_ids"] = ids  # last: the long list after the readable fields
    _write_json(meta_path, meta_json)
    return [cfg, weights, meta_path]
