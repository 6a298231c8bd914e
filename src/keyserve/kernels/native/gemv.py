"""torch-facing wrapper of the native few-row product over row-major weights (``gemv.c``)."""

from __future__ import annotations

import torch

from keyserve.kernels.native import library, require_library

# Rows up to which one pass over the weights (every row against every weight row while it is
# in cache) beats the BLAS: decode batches, speculative verification (B sequences x K + 1
# positions), the LM head over the sampled rows. Beyond, the product is compute-bound enough
# for torch's GEMM.
MAX_ROWS = 16
WEIGHT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def supports(
    x: torch.Tensor,  # [m, in]
    weight: torch.Tensor,  # [out, in], row-major
    bias: torch.Tensor | None = None,  # [out]
) -> bool:
    return (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and weight.dtype in WEIGHT_DTYPES
        and x.dtype == weight.dtype
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and weight.dim() == 2
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous()))
        and not torch.is_grad_enabled()
        and library() is not None
    )


def gemv_float(
    x: torch.Tensor,  # [m, in] float32 or bfloat16
    weight: torch.Tensor,  # [out, in] float32 or bfloat16, row-major
    bias: torch.Tensor | None = None,  # [out], weight's dtype
) -> torch.Tensor:  # [m, out] float32; bf16-rounded values when the weight is bf16
    """``x @ weight.T (+ bias)`` reading every weight once for all rows, accumulated in float32.
    With bf16 weights the result is rounded to bf16 once (what bf16 ``F.linear`` returns) and
    handed back widened, so the LM head gets its float32 logits without another pass."""
    lib = require_library()
    m, n_in = x.shape
    n_out = weight.shape[0]
    if weight.shape[1] != n_in:
        raise ValueError(f"x has {n_in} features, weight expects {weight.shape[1]}")
    if not weight.is_contiguous():
        raise ValueError("weight must be row-major contiguous [out, in]")
    if bias is not None and (bias.shape != (n_out,) or bias.dtype != weight.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n_out}] tensor of the weight's dtype")
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    y = torch.empty(m, n_out, dtype=torch.float32)
    wdt = WEIGHT_DTYPES[weight.dtype]
    lib.keyserve_gemv(xf.data_ptr(), m, n_in, weight.data_ptr(), wdt,
                      None if bias is None else bias.data_ptr(), n_out, y.data_ptr(), wdt,
                      torch.get_num_threads())
    return y


def gemv(
    x: torch.Tensor,  # [m, in]
    weight: torch.Tensor,  # [out, in], row-major
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [m, out] in x's dtype
    """``F.linear`` for a few rows (see ``supports``)."""
    y = gemv_float(x, weight, bias)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def read_stream_gbps(buf: torch.Tensor, threads: int) -> tuple[float, float]:  # buf float32
    """(seconds, GB/s) of one front-to-back read of ``buf`` split over ``threads``: the read
    bandwidth a weight stream can reach at that thread count."""
    import time

    lib = require_library()
    t = time.perf_counter()
    lib.keyserve_read_stream(buf.data_ptr(), buf.numel(), threads)
    dt = time.perf_counter() - t
    return dt, buf.numel() * 4 / dt / 1e9
