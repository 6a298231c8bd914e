"""The bench-only venv that runs NVIDIA's kvpress (it pins transformers < 5.3, our own venv has
a newer one), built once and cached under ``~/.cache/keyserve/peers/kvpress-<key>/venv``
(``bench_venv.py``): kvpress with its own transformers, then what the worker needs to read our
model (safetensors) and the GGUF it is converted from (gguf).

    python -m bench.peers.kvpress_env      # build (or find) the venv, print where it is
"""

from __future__ import annotations

from pathlib import Path

from bench.peers import bench_venv
from bench.peers.bench_venv import clean_env  # noqa: F401  (kvpress_anchor's import)

KVPRESS_PIN = "kvpress==0.5.5"
PACKAGES = (KVPRESS_PIN, "safetensors", "gguf", "sentencepiece")


def ensure_venv(root: Path | None = None) -> Path:
    """Create the venv if its stamp is missing; return its python."""
    return bench_venv.ensure_venv("kvpress", PACKAGES, root)


if __name__ == "__main__":
    print(ensure_venv())
