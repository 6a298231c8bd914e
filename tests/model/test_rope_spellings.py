"""A config.json with both rope_parameters and a disagreeing rope_scaling is refused: transformers
follows rope_scaling, keyserve read rope_parameters, and the logits differed silently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from hf_refs import tiny_hf

from keyserve.model.config import ModelConfig


def test_rope_parameters_and_a_disagreeing_rope_scaling_are_refused(tmp_path: Path) -> None:
    tiny_hf("llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0}).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    cfg["rope_scaling"] = {"type": "linear", "factor": 4.0}
    path.write_text(json.dumps(cfg))
    oracle = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert oracle.config.rope_parameters["rope_type"] == "linear"  # what transformers computes
    with pytest.raises(ValueError, match="rope_parameters .* and rope_scaling .* disagree"):
        ModelConfig.from_file(path)
    agreeing = {**cfg, "rope_scaling": {"rope_type": "default"}}
    assert ModelConfig.from_dict(agreeing).rope.rope_type == "default"
    null = {**cfg, "rope_scaling": None}
    assert ModelConfig.from_dict(null).rope.rope_type == "default"
