"""Build and cache the peers that keyserve is benchmarked against, outside keyserve's own venv.

Everything lands under ``~/.cache/keyserve/peers/<key>/`` where ``<key>`` hashes what is built
(llama-cpp-python's version, the cmake flags, the Python version), so a second run reuses it:

* ``src/``   — the llama-cpp-python sdist, whose ``vendor/llama.cpp`` is the llama.cpp it binds;
* ``build/`` — ONE cmake build of that vendored llama.cpp (CPU, ``GGML_NATIVE=ON``, shared libs):
  ``build/bin/llama-server`` and ``build/bin/libllama.so`` come from the same compile, so
  llama-cpp-python and llama-server run the very same kernels;
* ``venv/``  — the bench-only venv: llama-cpp-python installed from that sdist with
  ``LLAMA_BUILD=OFF`` (its Python bindings only) and pointed at ``build/bin`` through
  ``LLAMA_CPP_LIB_PATH``; plus what llama.cpp's ``convert_hf_to_gguf.py`` needs (the CPU torch
  wheel pinned first, so pip never pulls a CUDA build; transformers; the vendored gguf-py).

Compiling takes 10+ minutes on two cores; it runs under ``nice -n 19`` with
``CMAKE_BUILD_PARALLEL_LEVEL=2``.

    python -m bench.peers.build          # build (or find) the peers, print where they are
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TORCH_PIN = "torch==2.13.0"  # the CPU wheel that lies on disk; installed before anything else
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
)
CONVERT_REQUIREMENTS = ("transformers", "safetensors", "sentencepiece", "protobuf")


@dataclass(frozen=True)
class Peers:
    """Where the built peers are."""

    root: Path

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def lib_dir(self) -> Path:  # libllama.so, libggml*.so
        return self.root / "build" / "bin"

    @property
    def llama_server(self) -> Path:
        return self.root / "build" / "bin" / "llama-server"

    @property
    def llama_cpp_src(self) -> Path:
        return self.root / "src" / "vendor" / "llama.cpp"

    @property
    def convert_script(self) -> Path:
        return self.llama_cpp_src / "convert_hf_to_gguf.py"

    @property
    def gguf_dir(self) -> Path:
        return self.root / "gguf"

    def env(self) -> dict[str, str]:
        """Environment for a process of the bench venv: its bindings load our compiled lib."""
        env = dict(os.environ)
        env["LLAMA_CPP_LIB_PATH"] = str(self.lib_dir)
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        return env


def build_key(version: str = LLAMA_CPP_PYTHON_VERSION, flags: tuple[str, ...] = CMAKE_FLAGS) -> str:
    """Hash of everything that decides what gets built: a change rebuilds in a new folder."""
    what = {
        "llama-cpp-python": version,
        "cmake": list(flags),
        "torch": TORCH_PIN,
        "convert": list(CONVERT_REQUIREMENTS),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]


def cache_root() -> Path:
    base = Path(os.environ.get("KEYSERVE_CACHE", Path.home() / ".cache" / "keyserve"))
    return base / "peers" / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}-{build_key()}"


def _run(cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed (exit {proc.returncode}); see {log}")


def _step(root: Path, name: str, log: Path, fn) -> None:
    """Run one build step once: its stamp file marks it done."""
    stamp = root / f".done-{name}"
    if stamp.exists():
        return
    t = time.perf_counter()
    print(f"peers: {name} …", file=sys.stderr, flush=True)
    fn()
    took = time.perf_counter() - t
    stamp.write_text(f"{took:.0f}\n")
    print(f"peers: {name} done in {took:.0f} s (log {log})", file=sys.stderr, flush=True)


def build_times(root: Path) -> dict[str, float]:
    """Seconds each build step took when it ran (read back from the stamps)."""
    return {p.name.removeprefix(".done-"): float(p.read_text()) for p in sorted(root.glob(".done-*"))}


def _build_env() -> dict[str, str]:
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL="2")
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    return env


NICE = ["nice", "-n", "19"]


def fetch_sdist(root: Path, log: Path) -> None:
    """llama-cpp-python's source release, unpacked to ``root/src``."""
    dl = root / "sdist"
    dl.mkdir(exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(dl)], log)
    [tgz] = list(dl.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(tgz) as tar:
        top = tar.getnames()[0].split("/")[0]
        tar.extractall(root, filter="data")
    (root / top).rename(root / "src")


def build_llama_cpp(root: Path, log: Path) -> None:
    """One cmake build of the vendored llama.cpp: libllama.so and llama-server."""
    peers, build = Peers(root), root / "build"
    _run(NICE + ["cmake", "-S", str(peers.llama_cpp_src), "-B", str(build), *CMAKE_FLAGS], log, _build_env())
    _run(NICE + ["cmake", "--build", str(build), "--target", "llama-server", "llama", "-j", "2"], log, _build_env())


def make_venv(root: Path, log: Path) -> None:
    """The bench-only venv: torch (CPU wheel) first, llama-cpp-python's bindings without a
    compile of their own (``LLAMA_BUILD=OFF``; they load ``build/bin/libllama.so``), and what
    ``convert_hf_to_gguf.py`` imports."""
    peers, env = Peers(root), _build_env()
    _run([sys.executable, "-m", "venv", str(root / "venv")], log, env)
    pip = [str(peers.python), "-m", "pip", "install", "-q"]
    _run(pip + [TORCH_PIN], log, env)  # first, so nothing below can pull a CUDA torch
    _run(NICE + pip + [str(root / "src")], log, dict(env, CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"))
    _run(pip + [TORCH_PIN, *CONVERT_REQUIREMENTS, str(peers.llama_cpp_src / "gguf-py")], log, env)


def ensure_peers(root: Path | None = None) -> Peers:
    """Build whatever is missing (sdist, llama.cpp build, bench venv); return where it lies."""
    root = root or cache_root()
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    _step(root, "sdist", log, lambda: fetch_sdist(root, log))
    _step(root, "llama-cpp", log, lambda: build_llama_cpp(root, log))
    _step(root, "venv", log, lambda: make_venv(root, log))
    return Peers(root)


if __name__ == "__main__":
    p = ensure_peers()
    print(json.dumps({"root": str(p.root), "python": str(p.python), "llama_server": str(p.llama_server),
                      "build_seconds": build_times(p.root)}, indent=1))
