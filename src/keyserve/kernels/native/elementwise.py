"""torch-facing wrappers of the fused elementwise kernels (``elementwise.c``): residual add +
RMSNorm, SiLU(gate) * up, rotary embedding. Same results as the torch ops they replace (up to
float32 summation order), in one pass each; callers check ``supports`` first."""

from __future__ import annotations

import torch

from keyserve.kernels.native import env_switch, library, require_library

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# KEYSERVE_NATIVE_ELEMENTWISE=0 keeps these ops on torch (A/B measurements; the rest of the
# native kernels stay on)
_ENABLED = env_switch("KEYSERVE_NATIVE_ELEMENTWISE")


def supports(*tensors: torch.Tensor) -> bool:
    """True where every tensor is a contiguous CPU float32/bf16 tensor of one dtype, outside
    autograd, and the native library is built."""
    first = tensors[0]
    return (
        _ENABLED
        and first.device.type == "cpu"
        and first.dtype in _DTYPES
        and not torch.is_grad_enabled()
        and all(t.dtype == first.dtype and t.is_contiguous() and t.device.type == "cpu" for t in tensors)
        and library() is not None
    )


def add_rms_norm(
    h: torch.Tensor,  # [..., hidden]
    y: torch.Tensor | None,  # [..., hidden] or None
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (h + y or h, rms_norm(h + y) * weight): [..., hidden] each
    """The residual sum (``h`` itself without ``y``) and its RMSNorm, as model/norm.py."""
    lib = require_library()
    hidden = h.shape[-1]
    n = h.numel() // hidden if hidden else 0
    out = torch.empty_like(h)
    h_out = torch.empty_like(h) if y is not None else h
    lib.keyserve_add_rms_norm(h.data_ptr(), None if y is None else y.data_ptr(),
                              None if y is None else h_out.data_ptr(), weight.data_ptr(), out.data_ptr(),
                              n, hidden, float(eps), _DTYPES[h.dtype], torch.get_num_threads())
    return h_out, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2 * inter] -> [..., inter]
    """``silu(gate) * up`` for ``gate_up = [gate | up]``, as LlamaMLP."""
    lib = require_library()
    two_inter = gate_up.shape[-1]
    n = gate_up.numel() // two_inter if two_inter else 0
    act = torch.empty(*gate_up.shape[:-1], two_inter // 2, dtype=gate_up.dtype)
    lib.keyserve_silu_mul(gate_up.data_ptr(), act.data_ptr(), n, two_inter // 2, _DTYPES[gate_up.dtype],
                          torch.get_num_threads())
    return act


def rotary(
    x: torch.Tensor,  # [n, heads, d], rows may be strided (a view of the fused qkv output)
    cos: torch.Tensor,  # [n, 1, d]: [c, c] in x's dtype
    sin: torch.Tensor,  # [n, 1, d]: [-s, s] in x's dtype
) -> torch.Tensor:  # [n, heads, d] contiguous
    """``x * cos + swap_halves(x) * sin``, as model/rope.py's apply_rotary."""
    lib = require_library()
    n, heads, d = x.shape
    out = torch.empty(n, heads, d, dtype=x.dtype)
    lib.keyserve_rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), n, heads, d,
                        _DTYPES[x.dtype], torch.get_num_threads())
    return out


def rotary_supports(
    x: torch.Tensor,  # [n, heads, d]
    cos: torch.Tensor,  # [n, 1, d]
    sin: torch.Tensor,  # [n, 1, d]
) -> bool:
    """``rotary`` takes heads contiguous within a row (any row stride) and contiguous tables."""
    return (
        supports(cos, sin)
        and x.dtype == cos.dtype
        and x.device.type == "cpu"
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
    )
