"""torch-facing float32 products of a few dozen rows on f32_block.c's register tiles.

Why: the layer stack of a float32 decode step already multiplies 8-64 rows this way
(decode_stack.c); its LM head -- 49152 x 576 for SmolLM2, a fifth of a step's multiplies -- went
to MKL's GEMM, which ran at ~160 GFLOP/s for 36 rows on the 2-core Xeon (perf, docs/engine.md)
where the tiles, prefetching the next packed block while they compute, run faster. The weight is
packed once (input-major blocks of 32 outputs: a second float32 copy, on huge pages) and kept
while the weight lives.
"""

from __future__ import annotations

import torch

from keyserve.kernels import huge_pages
from keyserve.kernels.native import env_switch, library, require_library
from keyserve.kernels.weight_cache import PerWeight

MIN_ROWS = 3  # fewer rows: gemv.h's row kernel streams the plain weight faster (measured in a step)
MAX_ROWS = 64  # past a step's rows, MKL's GEMM is compute-bound enough
COLS = 32  # outputs per packed block


def available() -> bool:
    lib = library()
    return lib is not None and env_switch("KEYSERVE_F32_BLOCKS") and bool(lib.keyserve_f32_block_available())


def pack_into(
    weight: torch.Tensor,  # [out, in] float32, row-major, out % 32 == 0
    buffer: torch.Tensor,  # [4 * out * in] uint8 (huge_pages.carve's)
) -> torch.Tensor:  # [out * in] float32: the tiles' layout (f32_block.c)
    packed = buffer.view(torch.float32)
    require_library().keyserve_f32_pack(weight.data_ptr(), weight.shape[0], weight.shape[1], packed.data_ptr())
    return packed


def _pack(weight: torch.Tensor) -> torch.Tensor:  # [out, in] float32 -> [out * in] float32
    return pack_into(weight, huge_pages.carve([4 * weight.numel()])[0])


packed_weight = PerWeight(_pack)


def supports(
    x: torch.Tensor,  # [m, in]
    weight: torch.Tensor,  # [out, in], row-major
) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.dim() == 2
        and weight.dim() == 2
        and MIN_ROWS <= x.shape[0] <= MAX_ROWS
        and x.shape[1] == weight.shape[1]
        and weight.shape[0] % COLS == 0
        and weight.is_contiguous()
        and weight.device.type == "cpu"
        and not torch.is_grad_enabled()
        and available()
    )


def f32_block_linear(
    x: torch.Tensor,  # [m, in] float32
    weight: torch.Tensor,  # [out, in] float32, row-major, out % 32 == 0
) -> torch.Tensor:  # [m, out] float32
    """``x @ weight.T``; sums in input order, so equal to ``F.linear`` to float32 rounding."""
    lib = require_library()
    m, k = x.shape
    n = weight.shape[0]
    xc = x if x.is_contiguous() else x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    rc = lib.keyserve_f32_linear(xc.data_ptr(), m, k, packed_weight(weight).data_ptr(), n, y.data_ptr(),
                                 torch.get_num_threads())
    if rc:
        raise RuntimeError("f32_block_linear: this build has no float32 register tiles")
    return y
