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

# Fewer rows: gemv.h's row kernel streams the plain weight faster. AVX-512 tiles: 3 (measured in
# a step); AVX2 tiles (6 rows x 16 outputs): 4 -- SmolLM2's [49152, 576] head on the 2-core EPYC,
# 3 / 4 / 8 / 16 rows at 1.05x / 0.89x / 0.84x / 0.61x gemv's time (best of 9 interleaved).
MIN_ROWS = {1: 3, 2: 4}
MAX_ROWS = 64  # past a step's rows, MKL's GEMM is compute-bound enough
COLS = 32  # outputs per packed block


def kind() -> int:
    """1: AVX-512 tiles, 2: AVX2 tiles (f32_block.c), 0: none (no build, or ``KEYSERVE_F32_BLOCKS=0``)."""
    lib = library()
    return int(lib.keyserve_f32_block_available()) if lib is not None and env_switch("KEYSERVE_F32_BLOCKS") else 0


def available() -> bool:
    return kind() > 0


def min_rows() -> int:
    """The fewest rows of a product the tiles take (``MIN_ROWS``; 0 without tiles)."""
    return MIN_ROWS.get(kind(), 0)


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
        and x.shape[0] <= MAX_ROWS
        and x.shape[1] == weight.shape[1]
        and weight.shape[0] % COLS == 0
        and weight.is_contiguous()
        and weight.device.type == "cpu"
        and not torch.is_grad_enabled()
        and 0 < min_rows() <= x.shape[0]  # 0: no tiles in this build, or switched off
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
