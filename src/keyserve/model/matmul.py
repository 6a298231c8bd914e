"""``linear`` that keeps bfloat16 usable on CPUs without native bfloat16 matmul.

On x86 CPUs without AVX512-BF16/AMX (this project's 2-core AVX2 EPYC is one), torch's bf16
GEMM falls back to a generic loop: a 1024^3 matmul runs at ~0.4 GFLOP/s against ~26 in
float32, and an ``[m, k] x [k, n]`` product costs ``m`` separate matrix-vector passes. Its
matrix-vector kernel (m = 1, batch-1 decode) is fine and reads only the 2-byte weights, so we
keep it for a few rows; from ``NATIVE_MAX_ROWS + 1`` rows on we widen the weights to float32 and
run float32 GEMM. Both accumulate in float32 and round the result to bf16 once.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from keyserve.kernels.native import amx as native_amx
from keyserve.kernels.native import gemv as native_gemv
from keyserve.kernels.native import linear as native_linear
from keyserve.model import packed_linear

NATIVE_MAX_ROWS = 3  # measured crossover on the AVX2 CPU: native wins at 1-3 rows, loses from 4


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True where the CPU advertises bf16 dot-product instructions (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return True  # unknown platform: trust torch's own kernels


def linear(
    x: torch.Tensor,  # [m, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [m, out], x's dtype
    """``F.linear`` with CPU fast paths: up to 16 float32 or bf16 rows (decode, speculative
    verification, small batches) go to a native kernel that streams the weights once for all
    rows -- ``kernels/native/gemv.c`` for row-major weights (what the model keeps where the
    native kernels are built), ``skinny_linear.c`` for column-major float32 ones; bf16 beyond
    that is widened to float32 GEMM where the CPU has no bf16 dot product (see the module
    docstring); bf16 beyond it, where the CPU has bf16 dot products, runs oneDNN on weights
    packed once (``packed_linear``). Where the CPU has AMX, bf16 products of 2-48 rows go to
    AMX tiles on weights packed once (``kernels/native/amx.py``): bound by the weight stream,
    1.05-1.27x oneDNN's packed path there."""
    if native_amx.supports(x, weight, bias):
        return native_amx.amx_linear(x, weight)
    if native_gemv.supports(x, weight, bias):
        return native_gemv.gemv(x, weight, bias)
    if bias is None and native_linear.supports(x, weight):
        return native_linear.skinny_linear(x, weight)
    if packed_linear.supports(x, weight) and cpu_has_native_bf16():
        return packed_linear.packed_linear(x, weight, bias)
    if (
        weight.dtype in (torch.bfloat16, torch.float16)
        and weight.device.type == "cpu"
        and x.shape[0] > NATIVE_MAX_ROWS
        and not cpu_has_native_bf16()
    ):
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(x.dtype)
    return F.linear(x, weight, bias)


def use_cpu_gemv_layout(module: torch.nn.Module) -> None:
    """Store the module's float32 CPU matrices column-major: ``[out, in]`` views of ``[in, out]``
    contiguous storage. Values and shapes are unchanged; ``F.linear`` then hands the BLAS a
    non-transposed ``[in, out]`` operand, whose matrix-vector product streams the weights
    markedly faster here: measured on this 2-core AVX2 CPU over SmolLM2's 30 layers, 23 vs
    29 ms at 1 row, 35 vs 50 ms at 2 rows, equal from 4 rows on; the 49152-row LM head at 1 row
    4.7 vs 8.5 ms. Decode at small batch is bound by exactly that stream. Embedding lookups
    read a strided row, which costs nothing measurable at decode and little next to a prefill
    chunk's matmuls."""
    for param in module.parameters():
        if param.dim() == 2 and param.dtype == torch.float32 and param.device.type == "cpu":
            if param.stride() == (param.shape[1], 1):  # row-major: relayout once
                param.data = param.data.t().contiguous().t()
