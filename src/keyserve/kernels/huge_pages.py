"""CPU tensors on transparent huge pages: the weights and the KV cache that every step streams.

Why: decode is a stream over the weights (batch 1) and over scattered KV blocks (many rows).
With 4 KB pages each page of that stream costs a TLB miss and the hardware prefetcher stops at
every page boundary; with 2 MB pages a whole model's weights fit in the second-level TLB.
Measured on the 2-core Xeon (docs/engine.md, "Huge pages"): a float32 sum over 538 MB read
21.5 GB/s on 4 KB pages and 29.2 GB/s on huge pages; torch's GEMV 27.2 -> 28.1 GB/s; the native
paged decode over 36 sequences' scattered float32 blocks 14.5 -> 17.0 GB/s.

Most Linux distributions ship transparent huge pages in ``madvise`` mode: memory gets them only
when asked with ``madvise(MADV_HUGEPAGE)`` before its pages are first touched. So the memory is
reserved untouched (``torch.empty`` of a size glibc serves with a fresh ``mmap``), the 2 MB
aligned stretch inside it advised, and only then written. Where the kernel has no THP, the mode
is ``never``, the platform is not Linux, or ``KEYSERVE_HUGE_PAGES=0``, the tensors are ordinary
ones: the bytes are the same either way, only their pages differ.
"""

from __future__ import annotations

import ctypes
import math
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from keyserve.kernels.native import env_switch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
_ALIGN = 64  # each tensor in an arena starts on a cache line
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_madvise = None


def available() -> bool:
    """True where advised memory can get huge pages (Linux with THP not ``never``) and
    ``KEYSERVE_HUGE_PAGES`` is not off."""
    global _madvise
    if not env_switch("KEYSERVE_HUGE_PAGES") or not sys.platform.startswith("linux"):
        return False
    try:
        mode = _THP_MODE.read_text()
    except OSError:
        return False
    if "[never]" in mode:
        return False
    if _madvise is None:
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            _madvise = libc.madvise
            _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            return False
    return True


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised flat CPU tensor of ``numel`` elements whose 2 MB-aligned pages are
    advised huge before anything touches them (an ordinary ``torch.empty`` where huge pages
    are not available or the tensor is smaller than one huge page)."""
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE or not available():
        return torch.empty(numel, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    body = raw[start : start + nbytes]
    advised = nbytes - nbytes % HUGE_PAGE
    _madvise(body.data_ptr(), advised, MADV_HUGEPAGE)  # a refusal leaves ordinary pages: same bytes
    return body.view(dtype)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape)`` on huge pages where available."""
    return empty(math.prod(shape), dtype).zero_().view(shape)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def carve(tensors_bytes: Iterable[int]) -> list[torch.Tensor]:
    """Uninitialised uint8 buffers of the given sizes laid end to end in one huge-page arena,
    each on a 64-byte boundary: small tensors share huge pages instead of each getting
    ordinary ones (view each as its dtype)."""
    sizes = list(tensors_bytes)
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += _aligned(n)
    arena = empty(max(total, 1), torch.uint8)
    return [arena[off : off + n] for off, n in zip(offsets, sizes, strict=True)]


@torch.no_grad()
def rehome_parameters(module: torch.nn.Module) -> int:
    """Move every contiguous CPU parameter and buffer of ``module`` into one huge-page arena
    (``carve``), in place (``.data`` swapped, so tied parameters stay tied and holders of the
    Parameter objects see the move); returns the bytes moved, 0 where huge pages are not
    available."""
    if not available():
        return 0
    seen: dict[int, torch.Tensor] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        # a strided layout (use_cpu_gemv_layout's column-major weights) stays where it is
        if t.device.type == "cpu" and t.numel() and t.is_contiguous() and id(t) not in seen:
            seen[id(t)] = t
    tensors = list(seen.values())
    buffers = carve(t.numel() * t.element_size() for t in tensors)  # reserved, not yet touched
    for t, buf in zip(tensors, buffers, strict=True):
        # one tensor at a time: its old storage is freed as the next is copied, so the peak is
        # the model plus one tensor, not two models (an 8B bf16 model is 16 GB)
        copy = buf.view(t.dtype).view(t.shape)
        copy.copy_(t.data)
        t.data = copy
    return sum(_aligned(t.numel() * t.element_size()) for t in tensors)
