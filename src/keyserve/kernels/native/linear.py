"""torch-facing wrapper of the native few-row float32 product (``skinny_linear.c``)."""

from __future__ import annotations

import torch

from keyserve.kernels.native import library, require_library

# Rows up to which the native kernel matches or beats the BLAS on column-major weights; beyond
# it the product is compute-bound enough for the BLAS's GEMM. `python bench/linear_bench.py`
# (docs/BENCHMARKS.md, "linear": SmolLM2-135M's 540 MB of float32 weights on the 2-core AVX2
# CPU this project runs on), ms per pass, F.linear vs this kernel:
#   2 threads: m=1 34.9 vs 23.4, m=2 48.9 vs 30.4, m=4 71.0 vs 33.6, m=8 62.8 vs 40.8,
#              m=16 73.8 vs 51.5, m=32 96.4 vs 91.7
#   1 thread:  m=1 36.4 vs 39.6, m=2 49.4 vs 49.9, m=4 65.6 vs 58.3, m=8 75.9 vs 76.3,
#              m=16 97.6 vs 96.7, m=32 137.7 vs 177.2
# so one row goes native only with several threads (the BLAS's matrix-vector product streams
# faster on one), and 2..16 rows always (a batch of 8 verifying 2 positions each is 16 rows).
MAX_ROWS = 16


def supports(
    x: torch.Tensor,  # [m, in]
    weight: torch.Tensor,  # [out, in], column-major storage (``weight.t()`` contiguous)
) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.dim() == 2
        and (1 < x.shape[0] <= MAX_ROWS or (x.shape[0] == 1 and torch.get_num_threads() > 1))
        and weight.t().is_contiguous()
        and not torch.is_grad_enabled()
        and library() is not None
    )


def skinny_linear(
    x: torch.Tensor,  # [m, in] float32
    weight: torch.Tensor,  # [out, in] float32, stored column-major
) -> torch.Tensor:  # [m, out] float32
    """``x @ weight.T`` reading the weights once for all ``m`` rows."""
    lib = require_library()
    m, n_in = x.shape
    n_out = weight.shape[0]
    if weight.shape[1] != n_in:
        raise ValueError(f"x has {n_in} features, weight expects {weight.shape[1]}")
    xc = x if x.is_contiguous() else x.contiguous()
    y = torch.empty(m, n_out, dtype=torch.float32)
    lib.keyserve_skinny_linear(xc.data_ptr(), m, n_in, weight.t().data_ptr(), n_out, y.data_ptr())
    return y
