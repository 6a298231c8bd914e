"""Rotary position embeddings with a precomputed cos/sin table indexed by position.

The inverse frequencies are computed exactly as transformers computes them (same float32
operations in the same order), so cos/sin -- and therefore rotated keys -- are bit-identical
to transformers' for every supported rope type. The table is built once for all positions up
to ``max_position_embeddings``; each forward step only gathers rows.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from keyserve.kernels.native import elementwise as native_elementwise
from keyserve.model.config import RopeConfig


def _base_inv_freq(theta: float, dim: int, device: torch.device | None = None) -> torch.Tensor:
    """[dim // 2] float32: ``1 / theta^(2i/dim)``, the unscaled RoPE frequencies."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
    return 1.0 / (theta ** (exponents / dim))


def _llama3_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Llama 3.1: divide low frequencies by ``factor``, keep high ones, blend in between."""
    inv_freq = _base_inv_freq(rope.theta, dim)
    factor = rope.factor
    low, high = rope.low_freq_factor, rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings
    assert factor is not None and low is not None and high is not None and old_context_len
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: RopeConfig, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, and scale cos/sin."""
    base = rope.theta
    orig = rope.original_max_position_embeddings or max_pos
    factor = rope.factor if rope.factor is not None else max_pos / orig
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(
                _yarn_get_mscale(factor, rope.mscale) / _yarn_get_mscale(factor, rope.mscale_all_dim)
            )
        else:
            attention_factor = _yarn_get_mscale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def compute_inv_freq(rope: RopeConfig, head_dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """([head_dim // 2] float32 inverse frequencies, cos/sin scale) for positions < max_pos.

    ``dynamic`` (NTK) only rescales beyond ``max_position_embeddings``; inside the context it is
    the default RoPE, which is all a table limited to the context can hold.
    """
    if rope.rope_type in ("default", "dynamic"):
        return _base_inv_freq(rope.theta, head_dim), 1.0
    if rope.rope_type == "linear":
        assert rope.factor is not None
        return _base_inv_freq(rope.theta, head_dim) / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, head_dim), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim, max_pos)
    raise ValueError(f"unsupported rope type {rope.rope_type!r}")


class RotaryEmbedding(nn.Module):
    """Holds ``cos``/``sin`` tables ``[max_pos, head_dim // 2]`` (float32) and rotates q/k."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_pos: int) -> None:
        super().__init__()
        inv_freq, scaling = compute_inv_freq(rope, head_dim, max_pos)
        freqs = torch.arange(max_pos, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.attention_scaling = scaling
        self.max_pos = max_pos
        self.register_buffer("cos_table", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin_table", freqs.sin() * scaling, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, signed sin: [num_tokens, 1, head_dim]
        """Gather this step's rows once; every layer reuses them.

        Returns ``cos`` as ``[c, c]`` and ``sin`` as ``[-s, s]`` so that the rotation is
        ``x * cos + swap_halves(x) * sin``: four kernels per call instead of seven.
        """
        c = self.cos_table.index_select(0, positions).to(dtype)
        s = self.sin_table.index_select(0, positions).to(dtype)
        return torch.cat((c, c), -1).unsqueeze(1), torch.cat((-s, s), -1).unsqueeze(1)


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]: [c, c]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim]: [-s, s]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], contiguous
    """Rotate-half RoPE (the Hugging Face layout): ``x*cos + rotate_half(x)*sin``.

    ``rotate_half(x) * [s, s]`` is ``[-x2 * s, x1 * s]`` = ``swap_halves(x) * [-s, s]`` exactly
    (negation is exact), so the result is bit-identical to transformers'.
    """
    if native_elementwise.rotary_supports(x, cos, sin):  # one pass (kernels/native/elementwise.c)
        return native_elementwise.rotary(x, cos, sin)
    n, h, d = x.shape
    swapped = x.reshape(n, h, 2, d // 2).flip(2).reshape(n, h, d)
    return x * cos + swapped * sin
