"""Shared fixtures: the real models at hand (no hub, local paths only)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Triton chooses between its interpreter and its compiler when it is first imported: that is
# when triton.language's own @jit helpers (tl.zeros, tl.sum, ...) are decorated. Packages the
# tests import at collection (transformers, Ray Serve) import triton, so the kernel tests'
# choice -- the interpreter wherever there is no CUDA -- must be made here, before any test
# module is imported (tests/kernels/conftest.py checks it held).
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

SHARED_MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"
STORIES = Path(os.environ.get("KEYSERVE_STORIES260K", SHARED_MODELS / "stories260k"))


@pytest.fixture(scope="session")
def stories_path() -> str:
    if not (STORIES / "config.json").exists():
        pytest.fail(f"stories260K not found at {STORIES} (set KEYSERVE_STORIES260K)")
    return str(STORIES)


@pytest.fixture(scope="session")
def stories_hf(stories_path: str):
    """The oracle: Hugging Face transformers on stories260K's weights (float32, eager
    attention), loaded once per session; tests only run forwards on it."""
    transformers = pytest.importorskip("transformers")
    import torch

    return transformers.AutoModelForCausalLM.from_pretrained(
        stories_path, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def draft_dir(stories_path: str, tmp_path_factory) -> str:
    """A real draft on disk: stories260K with its layers perturbed, so it disagrees with the
    target now and then (speculative tests need both accepts and rejects)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("draft")
    for f in Path(stories_path).iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    weights = load_file(str(Path(stories_path) / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    save_file({k: (v + 0.03 * torch.randn(v.shape, generator=gen) if "layers" in k else v).contiguous()
               for k, v in weights.items()}, str(out / "model.safetensors"))
    return str(out)
