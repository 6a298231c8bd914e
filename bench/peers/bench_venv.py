"""Bench-only virtual environments for peers whose pins conflict with ours (kvpress pins
transformers < 5.3; lm-eval brings its own stack), built once and cached under
``~/.cache/keyserve/peers/<name>-<key>/venv``.

torch is pinned first to the CPU wheel that lies on disk, so pip never pulls a CUDA build; then
the peer's packages. The key hashes the pins and the Python version: a change builds a new venv
beside the old one. Nothing of ours is installed there: the peers reach keyserve over HTTP or
through files.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TORCH_PIN = "torch==2.13.0"  # the CPU wheel on disk; installed before anything else
NICE = ["nice", "-n", "19"]


def build_key(packages: tuple[str, ...]) -> str:
    what = {"torch": TORCH_PIN, "packages": list(packages),
            "python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]


def cache_root(name: str, packages: tuple[str, ...]) -> Path:
    base = Path(os.environ.get("KEYSERVE_CACHE", Path.home() / ".cache" / "keyserve"))
    return base / "peers" / f"{name}-{build_key(packages)}"


def clean_env() -> dict[str, str]:
    """Environment for a process of a bench venv (nothing of ours leaks in)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    return env


def ensure_venv(name: str, packages: tuple[str, ...], root: Path | None = None) -> Path:
    """Create the venv if its stamp is missing; return its python."""
    root = root or cache_root(name, packages)
    python = root / "venv" / "bin" / "python"
    stamp = root / ".done-venv"
    if stamp.exists():
        return python
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    t = time.perf_counter()
    print(f"{name} venv: building under {root} (log {log}) …", file=sys.stderr, flush=True)
    pip = NICE + [str(python), "-m", "pip", "install", "-q"]
    for cmd in ([sys.executable, "-m", "venv", str(root / "venv")],
                pip + [TORCH_PIN],  # first, so nothing below can pull a CUDA torch
                pip + [TORCH_PIN, *packages]):
        with open(log, "a") as f:
            f.write(f"\n$ {' '.join(cmd)}\n")
            f.flush()
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=clean_env()).returncode
        if rc:
            raise RuntimeError(f"{cmd[0]} failed (exit {rc}); see {log}")
    stamp.write_text(f"{time.perf_counter() - t:.0f}\n")
    return python
