"""Shared fixtures: the real models at hand (no hub, local paths only)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHARED_MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"
STORIES = Path(os.environ.get("KEYSERVE_STORIES260K", SHARED_MODELS / "stories260k"))


@pytest.fixture(scope="session")
def stories_path() -> str:
    if not (STORIES / "config.json").exists():
        pytest.fail(f"stories260K not found at {STORIES} (set KEYSERVE_STORIES260K)")
    return str(STORIES)
