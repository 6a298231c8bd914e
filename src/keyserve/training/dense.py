"""A plain batched Llama over ``[batch, time]`` tensors, for distillation only.

The serving model (``keyserve.model.llama``) runs over the paged KV cache and is frozen; to
*train* a draft and to let the target generate thousands of answers while recording its logits
we need autograd, padded batches and a contiguous per-row KV cache instead. Weights use the same
fused layout as the serving model (``[q; k; v]`` and ``[gate; up]`` rows), so tensors move
between the two without reshaping; parity with the serving model is tested.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from keyserve.model.config import ModelConfig
from keyserve.model.llama import LlamaForCausalLM
from keyserve.model.norm import RMSNorm
from keyserve.model.rope import compute_inv_freq


def _rotate(
    x: torch.Tensor,  # [B, T, heads, head_dim]
    cos: torch.Tensor,  # [B, T, 1, head_dim // 2]
    sin: torch.Tensor,  # [B, T, 1, head_dim // 2]
) -> torch.Tensor:  # [B, T, heads, head_dim]
    """Rotate-half RoPE (the Hugging Face layout), the serving model's arithmetic."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _Rotary(nn.Module):
    """cos/sin tables ``[max_pos, head_dim // 2]`` from the serving model's frequencies."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        max_pos = config.max_position_embeddings
        inv_freq, scaling = compute_inv_freq(config.rope, config.head_dim, max_pos)
        freqs = torch.arange(max_pos, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

    def forward(
        self, positions: torch.Tensor  # [B, T] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [B, T, 1, head_dim // 2]
        return self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)


@dataclass
class DenseKVCache:
    """Contiguous K/V per layer, one row per sequence slot; ``lengths`` tokens are valid."""

    keys: list[torch.Tensor]  # per layer [rows, kv_heads, max_len, head_dim]
    values: list[torch.Tensor]  # per layer [rows, kv_heads, max_len, head_dim]

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_layers: int, rows: int, max_len: int, dtype: torch.dtype
    ) -> DenseKVCache:
        shape = (rows, config.num_key_value_heads, max_len, config.head_dim)
        return cls(
            [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)],
            [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)],
        )


def _param(t: torch.Tensor, trainable: bool) -> nn.Parameter:  # t: any shape, kept
    """Share the tensor when frozen (the target's weights), copy it when it will be trained."""
    data = t.detach().clone().float() if trainable else t.detach()
    return nn.Parameter(data, requires_grad=trainable)


class DenseLayer(nn.Module):
    """One decoder layer; attention is dense causal (training) or over a ``DenseKVCache``."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], trainable: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, torch.float32, "cpu")
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, torch.float32, "cpu"
        )
        self.input_layernorm.weight = _param(tensors["input_layernorm"], trainable)
        self.post_attention_layernorm.weight = _param(tensors["post_attention_layernorm"], trainable)
        self.qkv = _param(tensors["qkv"], trainable)  # [(hq + 2 hkv) * d, hidden]
        self.o = _param(tensors["o"], trainable)  # [hidden, hq * d]
        self.gate_up = _param(tensors["gate_up"], trainable)  # [2 * inter, hidden]
        self.down = _param(tensors["down"], trainable)  # [hidden, inter]
        self.dropout = 0.0  # on both residual branches while training (small data overfits)

    def forward(
        self,
        h: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,  # [B, T, 1, head_dim // 2]
        sin: torch.Tensor,  # [B, T, 1, head_dim // 2]
        cache: tuple[torch.Tensor, torch.Tensor] | None,  # this layer's (keys, values) rows
        positions: torch.Tensor,  # [B, T] int64
        rows: torch.Tensor | None,  # [B] int64 cache rows of the batch (cache only)
    ) -> torch.Tensor:  # [B, T, hidden]
        b, t, _ = h.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = F.linear(self.input_layernorm(h), self.qkv).view(b, t, hq + 2 * hkv, d)
        qk = _rotate(qkv[:, :, : hq + hkv], cos, sin)
        q = qk[:, :, :hq].transpose(1, 2)  # [B, hq, T, d]
        k = qk[:, :, hq:].transpose(1, 2)  # [B, hkv, T, d]
        v = qkv[:, :, hq + hkv :].transpose(1, 2)
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = _cached_attention(q, k, v, cache, positions, rows)
        attn = F.linear(out.transpose(1, 2).reshape(b, t, hq * d), self.o)
        h = h + F.dropout(attn, self.dropout, self.training)
        gate, up = F.linear(self.post_attention_layernorm(h), self.gate_up).chunk(2, dim=-1)
        return h + F.dropout(F.linear(F.silu(gate) * up, self.down), self.dropout, self.training)


def _cached_attention(
    q: torch.Tensor,  # [B, hq, T, d]
    k: torch.Tensor,  # [B, hkv, T, d]
    v: torch.Tensor,  # [B, hkv, T, d]
    cache: tuple[torch.Tensor, torch.Tensor],  # ([rows, hkv, L, d], [rows, hkv, L, d])
    positions: torch.Tensor,  # [B, T] int64, consecutive per row
    rows: torch.Tensor,  # [B] int64
) -> torch.Tensor:  # [B, hq, T, d]
    """Write this step's K/V at their positions, then attend each query to keys at positions
    up to its own (right padding beyond a row's length is never attended)."""
    keys, values = cache
    b, _, t, _ = k.shape
    row_idx = rows[:, None].expand(b, t)
    keys[row_idx, :, positions] = k.transpose(1, 2)  # [B, T, hkv, d] into [B, T] slots
    values[row_idx, :, positions] = v.transpose(1, 2)
    span = int(positions.max()) + 1
    if bool((rows == torch.arange(rows.numel())).all()):  # every slot, in order: no gather
        ks, vs = keys[: rows.numel(), :, :span], values[: rows.numel(), :, :span]
    else:
        ks, vs = keys[rows, :, :span], values[rows, :, :span]  # [B, hkv, span, d]
    allowed = torch.arange(span)[None, None, :] <= positions[:, :, None]  # [B, T, span]
    return F.scaled_dot_product_attention(q, ks, vs, attn_mask=allowed[:, None], enable_gqa=True)


class DenseLlama(nn.Module):
    """Embedding (shared with the target, frozen) -> layers -> norm -> an LM head over
    ``head_ids`` (all tokens when None, tied to the embedding)."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,  # [vocab, hidden], the target's, never trained
        layers: list[dict[str, torch.Tensor]],
        norm: torch.Tensor,  # [hidden]
        head: torch.Tensor | None,  # [N, hidden] rows for head_ids, or None = tied embedding
        trainable: bool,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Parameter(embed.detach(), requires_grad=False)
        self.layers = nn.ModuleList(DenseLayer(config, t, trainable) for t in layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, torch.float32, "cpu")
        self.norm.weight = _param(norm, trainable)
        self.head = self.embed if head is None else _param(head, trainable)
        self.rotary = _Rotary(config)

    @classmethod
    def from_serving(
        cls,
        model: LlamaForCausalLM,
        layer_ids: list[int] | None = None,
        head_ids: torch.Tensor | None = None,  # [N] int64 token ids of a pruned head
        trainable: bool = False,
    ) -> DenseLlama:
        """Wrap (frozen: share) or copy (trainable) a serving model's weights, optionally keeping
        only ``layer_ids`` and the LM-head rows ``head_ids`` -- how a draft is initialised."""
        if model.tp.size != 1:
            raise ValueError("distillation needs the whole model (tp_size 1)")
        src = model.model.layers
        ids = list(range(len(src))) if layer_ids is None else layer_ids
        tensors = [
            {
                "input_layernorm": src[i].input_layernorm.weight,
                "post_attention_layernorm": src[i].post_attention_layernorm.weight,
                "qkv": src[i].self_attn.qkv_proj.weight,
                "o": src[i].self_attn.o_proj.weight,
                "gate_up": src[i].mlp.gate_up_proj.weight,
                "down": src[i].mlp.down_proj.weight,
            }
            for i in ids
        ]
        c = model.config
        if c.qkv_bias or c.o_bias or c.mlp_bias or c.sliding_window is not None:
            raise ValueError("distillation supports bias-free, full-attention Llama models")
        head = None
        if head_ids is not None:
            head = model.lm_head_weight.detach().index_select(0, head_ids)
        elif not c.tie_word_embeddings:
            head = model.lm_head_weight
        return cls(c, model.model.embed_tokens.weight, tensors, model.model.norm.weight, head, trainable)

    def set_dropout(self, p: float) -> None:
        for layer in self.layers:
            layer.dropout = p

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B, T] int64
        cache: DenseKVCache | None = None,
        rows: torch.Tensor | None = None,  # [B] int64 cache rows (with cache)
    ) -> torch.Tensor:  # [B, T, hidden] final-norm hidden states
        h = F.embedding(input_ids, self.embed).float()
        cos, sin = self.rotary(positions)
        for i, layer in enumerate(self.layers):
            kv = None if cache is None else (cache.keys[i], cache.values[i])
            h = layer(h, cos, sin, kv, positions, rows)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., N] float32
        return F.linear(hidden, self.head).float()
