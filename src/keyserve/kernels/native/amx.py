"""torch-facing wrapper of the AMX few-row bf16 product (``amx_linear.c``).

bf16 products of 2-48 rows -- decode steps, speculative verification, the LM head over the
sampled rows -- are bound by streaming the weights once; the vector kernels (gemv.c) become
bound by their multiplies past a few rows and oneDNN's prepacked path reads the weights at about
half the bandwidth here (bench/packed_linear_bench.py). AMX tiles do the multiplies of 16 rows
at once, so the stream is the limit. Weights are packed into tiles once, at the first product
with them, and kept while they live (a second copy of each bf16 weight used this way); the
one-call decode step (decode_stack.py) packs its layers through the same cache.

``KEYSERVE_AMX=0`` switches it off (and with it the decode step's AMX products).
"""

from __future__ import annotations

import functools

import torch

from keyserve.kernels.native import env_switch, library, require_library
from keyserve.kernels.weight_cache import PerWeight
from keyserve.kernels.workspace import scratch

MIN_ROWS, MAX_ROWS = 2, 64  # amx.h's KS_AMX_MIN_ROWS, KS_AMX_MAX_ROWS
# The most rows a torch-path product takes here (bench/packed_linear_bench.py, 2 threads: 1.2-1.27x
# oneDNN's prepacked path at 2-32 rows, 1.05x at 48, 0.96x at 64); the one-call decode step,
# which has no oneDNN, uses the tiles up to MAX_ROWS.
LINEAR_MAX_ROWS = 48


@functools.cache
def _hardware() -> bool:
    lib = library()
    return lib is not None and bool(lib.keyserve_amx_available())


def available() -> bool:
    """True where the native library has AMX, the kernel lets this process use it and
    ``KEYSERVE_AMX`` does not say 0."""
    return env_switch("KEYSERVE_AMX") and _hardware()


def packable(weight: torch.Tensor) -> bool:  # [out, in]
    """A bf16 CPU matrix the tiles divide: outputs by 16, inputs by 32."""
    return (
        weight.dim() == 2
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 32 == 0
    )


def supports(
    x: torch.Tensor,  # [m, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None = None,  # [out]
) -> bool:
    return (
        bias is None
        and x.dim() == 2
        and x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and MIN_ROWS <= x.shape[0] <= LINEAR_MAX_ROWS
        and packable(weight)
        and not torch.is_grad_enabled()
        and available()
    )


def _pack(weight: torch.Tensor) -> torch.Tensor:  # [out, in] bf16 -> [out * in] bf16
    if not packable(weight):
        raise ValueError(f"AMX packing needs a bf16 CPU [out % 16, in % 32] matrix, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    w = weight.detach().contiguous()
    packed = torch.empty(w.numel(), dtype=torch.bfloat16)
    require_library().keyserve_amx_pack(w.data_ptr(), w.shape[0], w.shape[1], packed.data_ptr())
    return packed


# ``weight`` in AMX tiles (amx_linear.c's layout), packed once per weight
_PACKED = PerWeight(_pack)


def packed_weight(weight: torch.Tensor) -> torch.Tensor:  # weight [out, in] bf16 -> [out * in] bf16
    """``weight`` in AMX tiles, packed at its first use and kept while it lives."""
    return _PACKED(weight)


def amx_linear(
    x: torch.Tensor,  # [m, in] bf16, 2 <= m <= 64
    weight: torch.Tensor,  # [out, in] bf16
) -> torch.Tensor:  # [m, out] bf16
    """``F.linear(x, weight)`` on AMX tiles: float32 sums rounded once to bf16, as F.linear;
    the summation order is the tiles', so a value may differ from oneDNN's in its last bit."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} inputs, weight {weight.shape[1]}")
    packed = packed_weight(weight)
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.bfloat16)
    xpad = scratch("amx_xpad", (MAX_ROWS * k,), torch.bfloat16)
    acc = scratch("amx_acc", (n * MAX_ROWS,), torch.float32)
    rc = require_library().keyserve_amx_linear(
        x.data_ptr(), m, k, packed.data_ptr(), n, y.data_ptr(), xpad.data_ptr(), acc.data_ptr(),
        torch.get_num_threads(),
    )
    if rc:
        raise RuntimeError("AMX product refused its arguments (amx_linear.c)")
    return y
