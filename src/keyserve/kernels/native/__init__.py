"""Native CPU kernels: C sources compiled on first use with the system's C compiler.

Why not a torch C++ extension: those include the torch headers and take a minute to build on
two cores; these are plain C with OpenMP, built in about a second, loaded with ``ctypes``, and
called with raw pointers. The shared library links ``libgomp.so.1``, the OpenMP runtime torch
has already loaded, so both share one thread pool.

Built libraries are cached under ``$KEYSERVE_CACHE_DIR/native`` (default
``~/.cache/keyserve/native``), keyed by the source, the compiler and the CPU's flags, so a
different machine rebuilds rather than running code tuned for another CPU. Without a compiler,
or with ``KEYSERVE_NATIVE_KERNELS=0``, :func:`library` returns ``None`` and callers use the
pure-torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = ("paged_decode.c", "skinny_linear.c", "gemv.c", "decode_stack.c", "elementwise.c", "amx_linear.c", "f32_block.c")
HEADERS = ("attend.h", "gemv.h", "vecmath.h", "amx.h", "f32_block.h")  # included by the sources: part of the cache key
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", "-std=c11")


def _cache_dir() -> Path:
    root = os.environ.get("KEYSERVE_CACHE_DIR") or os.path.join(Path.home(), ".cache", "keyserve")
    return Path(root) / "native"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def env_switch(name: str) -> bool:
    """An on-by-default switch: off for ``0``, ``false``, ``no`` or ``off`` (any case), on for
    ``1``, ``true``, ``yes``, ``on`` or unset; anything else is a ValueError naming the variable
    (a typo silently meant "on")."""
    value = os.environ.get(name, "1").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on", ""):
        return True
    raise ValueError(f"${name} must be 0/1, true/false, yes/no or on/off, not {os.environ[name]!r}")


def enabled() -> bool:
    return env_switch("KEYSERVE_NATIVE_KERNELS")


def _build(compiler: str, out: Path) -> None:
    sources = [str(Path(__file__).with_name(name)) for name in SOURCES]
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", prefix=".build-", dir=out.parent)
    os.close(fd)
    try:
        base = [compiler, *CFLAGS, *sources, "-o", tmp]
        try:  # glibc's vector expf/logf where the C library has them (x86-64 glibc does)
            subprocess.run([*base, "-DKEYSERVE_LIBMVEC", "-lmvec", "-lm"], check=True,
                           capture_output=True, text=True, timeout=300)
        except subprocess.CalledProcessError:
            subprocess.run([*base, "-lm"], check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)  # atomic: concurrent builders (test workers, TP ranks) race safely
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, building them if needed; ``None`` where that is not possible."""
    if not enabled():
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("keyserve: no C compiler found; CPU attention uses the pure-torch path")
        return None
    key = hashlib.sha256()
    for name in SOURCES + HEADERS:
        key.update(Path(__file__).with_name(name).read_bytes())
    key.update(" ".join((compiler, *CFLAGS, _cpu_flags())).encode())
    path = _cache_dir() / f"keyserve_native_{key.hexdigest()[:16]}.so"
    try:
        if not path.exists():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("keyserve: building the native CPU kernels failed (%s); using the "
                    "pure-torch path", detail)
        return None
    _declare(lib)
    return lib


def require_library() -> ctypes.CDLL:
    """The compiled kernels, for a caller that was told they apply (``supports``); raises
    where they cannot be built."""
    lib = library()
    if lib is None:
        raise RuntimeError("native CPU kernels are unavailable (see keyserve.kernels.native)")
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i, f, u32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_uint32
    lib.keyserve_paged_decode.restype = None
    lib.keyserve_paged_decode.argtypes = [
        p, p, p, i, p, i, p, i, i, i, i, i, f, i, p, i, p, p, p, u32, p, i, i, i, i, p,
    ]
    lib.keyserve_gumbel_noise.restype = None
    lib.keyserve_gumbel_noise.argtypes = [p, u32, u32, i, ctypes.c_int64, i, ctypes.c_int64, i, i]
    lib.keyserve_skinny_linear.restype = None
    lib.keyserve_skinny_linear.argtypes = [p, i, i, p, i, p]
    i64 = ctypes.c_int64
    lib.keyserve_amx_available.restype = ctypes.c_int
    lib.keyserve_amx_available.argtypes = []
    lib.keyserve_amx_pack.restype = None
    lib.keyserve_amx_pack.argtypes = [p, i64, i64, p]
    lib.keyserve_amx_linear.restype = ctypes.c_int
    lib.keyserve_amx_linear.argtypes = [p, i64, i64, p, i64, p, p, p, i]
    lib.keyserve_f32_block_available.restype = ctypes.c_int
    lib.keyserve_f32_block_available.argtypes = []
    lib.keyserve_f32_pack.restype = None
    lib.keyserve_f32_pack.argtypes = [p, i64, i64, p]
    lib.keyserve_f32_linear.restype = ctypes.c_int
    lib.keyserve_f32_linear.argtypes = [p, i, i64, p, i64, p, i]
    lib.keyserve_write_kv.restype = i64
    lib.keyserve_write_kv.argtypes = [p, p, p, p, p, i, i, i, i, i, i, i64]
    lib.keyserve_gemv.restype = None
    lib.keyserve_gemv.argtypes = [p, i, i, p, i, p, i, p, i, i]
    lib.keyserve_read_stream.restype = ctypes.c_double
    lib.keyserve_read_stream.argtypes = [p, i64, i]
    lib.keyserve_add_rms_norm.restype = None
    lib.keyserve_add_rms_norm.argtypes = [p, p, p, p, p, i64, i, f, i, i]
    lib.keyserve_silu_mul.restype = None
    lib.keyserve_silu_mul.argtypes = [p, p, i64, i, i, i]
    lib.keyserve_rotary.restype = None
    lib.keyserve_rotary.argtypes = [p, i64, p, p, p, i64, i, i, i, i]
    lib.keyserve_decode_stack.restype = i
    lib.keyserve_decode_stack.argtypes = [
        p, f, f, p, p, p, p, p, i, p, p, p, i64, i, i, p, i, p, i64, i, p, i, p,
    ]
