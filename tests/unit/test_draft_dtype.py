"""Which dtype the draft runs in (``SpeculativeConfig.draft_dtype``, ``build.resolve_draft_dtype``)."""

from __future__ import annotations

import pytest
import torch

from keyserve.config import EngineConfig
from keyserve.engine import build
from keyserve.kernels import native


def test_auto_is_bf16_under_a_float32_cpu_target_with_the_native_kernels(monkeypatch) -> None:
    want = torch.bfloat16 if native.library() is not None else torch.float32
    assert build.resolve_draft_dtype("auto", torch.float32, "cpu") is want
    assert build.resolve_draft_dtype("auto", torch.bfloat16, "cpu") is torch.bfloat16  # the target's
    assert build.resolve_draft_dtype("auto", torch.float32, "cuda") is torch.float32
    monkeypatch.setattr(native, "library", lambda: None)  # no compiler: torch's bf16 CPU path is slow
    assert build.resolve_draft_dtype("auto", torch.float32, "cpu") is torch.float32


def test_a_named_dtype_wins_and_float16_stays_off_the_cpu() -> None:
    assert build.resolve_draft_dtype("float32", torch.float32, "cpu") is torch.float32
    assert build.resolve_draft_dtype("bfloat16", torch.float32, "cuda") is torch.bfloat16
    with pytest.raises(ValueError, match="float16 is only supported on CUDA"):
        build.resolve_draft_dtype("float16", torch.float32, "cpu")


def test_the_flat_config_and_its_validation() -> None:
    assert EngineConfig.from_flat(draft_dtype="float32").spec.draft_dtype == "float32"
    assert EngineConfig.from_flat().spec.draft_dtype == "auto"
    with pytest.raises(ValueError, match="draft_dtype"):
        EngineConfig.from_flat(draft_dtype="int8")
