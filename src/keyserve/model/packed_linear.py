"""bf16 ``F.linear`` on oneDNN weights packed once, not on every call.

On CPUs with AMX / AVX512-BF16, bf16 ``F.linear`` goes to oneDNN, which reorders the plain
``[out, in]`` weight into its blocked layout on every call. For the 17-64-row products of a
busy decode step that reorder is a large share of the call: measured on the 2-core Xeon (AMX),
one thread, SmolLM2's 30 layers, the prepacked product took 25-30 % less CPU time at 17-64 rows
(``bench/packed_linear_bench.py`` has the table). The packed copy is made at the first call
with a given weight and kept while the weight lives; the plain weight stays where it is for the
native few-row kernels, so bf16 weights take twice their memory on such CPUs.

``KEYSERVE_PACKED_LINEAR=0`` switches it off.
"""

from __future__ import annotations

import functools

import torch

from keyserve.kernels.native import env_switch

from keyserve.kernels.weight_cache import PerWeight

# Batch-size hint for the reorder: oneDNN picks the blocked layout for this many rows; the
# packed weight serves any row count.
_PACK_ROWS_HINT = 64


@functools.cache
def available() -> bool:
    """True where torch's oneDNN linear with a prepacked weight can run bf16."""
    if not env_switch("KEYSERVE_PACKED_LINEAR"):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.zeros(8, 8, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS_HINT)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 8, dtype=torch.bfloat16), packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return True


def supports(
    x: torch.Tensor,  # [m, in]
    weight: torch.Tensor,  # [out, in]
) -> bool:
    return (
        weight.dtype == torch.bfloat16
        and x.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and x.device.type == "cpu"
        and weight.dim() == 2
        and not weight.requires_grad
        and not torch.is_grad_enabled()
        and available()
    )


# the oneDNN-blocked copy of each weight, made once per weight (and again if it is written in place)
_PACKED = PerWeight(lambda w: torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), _PACK_ROWS_HINT))


def packed_weight(weight: torch.Tensor) -> torch.Tensor:  # weight [out, in] bf16
    """The oneDNN-blocked copy of ``weight``, made once per weight (and again if it is
    written in place)."""
    return _PACKED(weight)


def packed_linear(
    x: torch.Tensor,  # [m, in] bf16
    weight: torch.Tensor,  # [out, in] bf16
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [m, out] bf16
    """``F.linear(x, weight, bias)`` on the packed copy of ``weight``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight(weight), bias, "none", [], "")
