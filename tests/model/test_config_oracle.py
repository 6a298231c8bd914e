"""A config.json silent on tie_word_embeddings means what transformers makes of it (untied:
the checkpoint's lm_head.weight is the head), checked against transformers itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from hf_refs import hf_logits, tiny_hf
from helpers.paged_runner import PagedRunner

from keyserve.engine.build import load_target
from keyserve.model.config import ModelConfig


def _save(hf: transformers.PreTrainedModel, directory: Path, **edits: object) -> Path:
    hf.save_pretrained(directory, safe_serialization=True)
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in edits.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))
    return directory


def _max_diff(directory: Path, hf: transformers.PreTrainedModel) -> float:
    ours = load_target(directory, torch.float32, torch.device("cpu"))
    toks = list(range(3, 43))
    with torch.inference_mode():
        got = PagedRunner(ours, num_blocks=32, block_size=4).teacher_forced({0: toks}, {0: 30})[0]
    return (got - hf_logits(hf, toks)).abs().max().item()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_config_silent_on_tying_uses_the_checkpoints_lm_head(arch: str, tmp_path: Path) -> None:
    """transformers' Llama/Mistral/Qwen2 configs default to untied: lm_head.weight is the head."""
    hf = tiny_hf(arch, tie_word_embeddings=False)
    d = _save(hf, tmp_path, tie_word_embeddings=None)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
    assert not oracle.config.tie_word_embeddings
    assert not ModelConfig.from_file(d / "config.json").tie_word_embeddings
    assert _max_diff(d, oracle.eval()) <= 1e-4


def test_config_silent_on_tying_without_lm_head_ties(tmp_path: Path) -> None:
    """No lm_head.weight in the checkpoint: the head can only be the embedding."""
    hf = tiny_hf("llama", tie_word_embeddings=True)
    d = _save(hf, tmp_path, tie_word_embeddings=None)
    assert ModelConfig.from_file(d / "config.json").tie_word_embeddings
    assert _max_diff(d, hf) <= 1e-4
    assert not ModelConfig.from_dict({**hf.config.to_dict(), "tie_word_embeddings": None}).tie_word_embeddings
