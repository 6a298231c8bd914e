"""Our Llama-family decoder over the paged KV cache (Llama, Mistral, Qwen2 layouts).

Tokens are flat -- ``[num_tokens]`` with no batch dimension -- because continuous batching packs
decode tokens and prefill chunks of many sequences into one step; ``AttentionMetadata`` says
which tokens belong to which sequence and where their K/V live. q/k/v and gate/up are each one
fused matmul (one pass over the weights per step, the batch-1 decode bound), held as
Megatron shards so the same classes serve tensor parallelism.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from keyserve.kernels import huge_pages
from keyserve.kernels.attention import paged_attention
from keyserve.kernels.native import elementwise as native_elementwise
from keyserve.kernels.native import f32_blocks
from keyserve.kernels.native import gemv as native_gemv
from keyserve.kernels.native import library as native_library
from keyserve.kernels.native.decode_stack import LayerWeights, NativeDecodeStack
from keyserve.kernels.metadata import AttentionMetadata, LayerScores
from keyserve.model.config import ModelConfig
from keyserve.model.kv_cache import KVCache, allocate_kv_cache
from keyserve.model.matmul import linear, use_cpu_gemv_layout
from keyserve.model.norm import RMSNorm
from keyserve.model.parallel import (
    AllReduce,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedEmbedding,
    RowParallelLinear,
    TPContext,
)
from keyserve.model.rope import RotaryEmbedding, apply_rotary

__all__ = ["LlamaForCausalLM", "allocate_kv_cache"]

_Device = torch.device | str


class LlamaAttention(nn.Module):
    """Grouped-query attention: fused qkv, RoPE on q and k together, paged attention, o_proj."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, tp: TPContext, dtype: torch.dtype, device: _Device
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.qkv_bias,
            tp,
            dtype,
            device,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            config.o_bias,
            tp,
            dtype,
            device,
            in_granule=config.head_dim,
        )

    def forward(
        self,
        x: torch.Tensor,  # [n, hidden]
        cos: torch.Tensor,  # [n, 1, head_dim]: [c, c]
        sin: torch.Tensor,  # [n, 1, head_dim]: [-s, s]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,  # [r] int64: only these tokens' outputs (None: all)
    ) -> tuple[torch.Tensor, LayerScores | None]:  # [n or r, hidden], scores when meta asks for them
        n = x.shape[0]
        hq, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(n, hq + 2 * hkv, self.head_dim)
        qk = apply_rotary(qkv[:, : hq + hkv], cos, sin)  # [n, hq + hkv, d]
        q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :]
        k_cache, v_cache = kv_cache
        out, scores = paged_attention(self.layer_idx, q, k, v, k_cache, v_cache, meta, self.scale,
                                      self.qkv_proj.q_head_start)
        out = out.reshape(n, hq * self.head_dim)
        if rows is not None:  # every token's K/V is written and scored above; fewer outputs
            out = out.index_select(0, rows)
        return self.o_proj(out), scores


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up as one matmul."""

    def __init__(
        self, config: ModelConfig, tp: TPContext, dtype: torch.dtype, device: _Device
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, config.intermediate_size, 2, config.mlp_bias, tp, dtype, device
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, config.mlp_bias, tp, dtype, device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        gate_up = self.gate_up_proj(x)
        if native_elementwise.supports(gate_up):  # one pass (kernels/native/elementwise.c)
            return self.down_proj(native_elementwise.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, tp: TPContext, dtype: torch.dtype, device: _Device
    ) -> None:
        super().__init__()
        self.sliding_window = config.layer_sliding_window(layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(config, layer_idx, tp, dtype, device)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, device
        )
        self.mlp = LlamaMLP(config, tp, dtype, device)

    def forward(
        self,
        h: torch.Tensor,  # [n, hidden]
        cos: torch.Tensor,  # [n, 1, head_dim]: [c, c]
        sin: torch.Tensor,  # [n, 1, head_dim]: [-s, s]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,  # [r] int64: only these tokens' outputs (None: all)
    ) -> tuple[torch.Tensor, LayerScores | None]:  # [n or r, hidden], this layer's attention scores
        attn, scores = self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta, rows)
        if rows is not None:
            h = h.index_select(0, rows)
        h, x = self.post_attention_layernorm.add_forward(h, attn)
        return h + self.mlp(x), scores


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelConfig, tp: TPContext, dtype: torch.dtype, device: _Device
    ) -> None:
        super().__init__()
        self.embed_tokens = ReplicatedEmbedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp, dtype, device) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        self.rotary.to(device)


class LlamaForCausalLM(nn.Module):
    """Flat-token decoder: ``forward`` gives final hidden states (and the attention scores a
    KV budget asks for, as a value), ``compute_logits`` the vocab.

    Logits are a separate call so the engine projects only the rows it samples from (the LM
    head is the largest single matmul of a small model).
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: _Device = "cpu",
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce: AllReduce | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = TPContext(tp_rank, tp_size, all_reduce)
        self.model = LlamaModel(config, self.tp, dtype, device)
        if config.tie_word_embeddings:
            self.lm_head_weight = self.model.embed_tokens.weight
        else:
            self.lm_head_weight = nn.Parameter(
                torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device),
                requires_grad=False,
            )
        self._full_attention_layers = [
            layer.sliding_window is None for layer in self.model.layers
        ]
        # The one-call native decode step (CPU, float32/bf16, tp 1), built by load_weights.
        self._native_decode: NativeDecodeStack | None = None

    @property
    def num_kv_heads(self) -> int:
        """kv heads held by this rank (the KV cache's third dimension)."""
        return self.model.layers[0].self_attn.num_kv_heads

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64, decode tokens first (meta's order)
        kv_caches: list[KVCache],  # one (k_cache, v_cache) per layer
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,  # [r] int64 token rows whose hidden states are wanted
    ) -> tuple[torch.Tensor, list[LayerScores] | None]:  # [num_tokens or r, hidden_size], scores
        """Final hidden states (of ``rows`` only, in their order, when given), and the attention
        scores of every layer when ``meta.score_mode`` asks for them (KV budgets; None otherwise).

        With ``rows`` the last layer still writes (and scores) every token's K/V but runs its
        output projection and MLP only for those rows: a prompt chunk needs the final state of
        its last token alone, and that is ~2.8 % of a 30-layer prefill's multiplies saved.

        A CPU step of decode rows only (no scores, few enough rows: ``ROW_LIMITS``) runs every layer in one native
        call (``kernels/native/decode_stack.c``); everything else runs the torch layers."""
        native = self._native_decode
        if (
            native is not None
            and native.takes(input_ids, meta)
            and native.weight_ptr == self.model.layers[0].self_attn.qkv_proj.weight.data_ptr()
        ):
            sliding = [not full for full in self._full_attention_layers]
            hidden = native.run(input_ids, positions, kv_caches, meta, sliding)
            if hidden is not None:
                return (hidden if rows is None else hidden.index_select(0, rows)), None
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(positions, h.dtype)
        full_meta = meta
        if meta.sliding_window is not None and any(self._full_attention_layers):
            # Mixed models (Qwen2 max_window_layers, layer_types): full layers ignore the window.
            full_meta = dataclasses.replace(meta, sliding_window=None)
        scores: list[LayerScores] | None = [] if meta.score_mode is not None else None
        last = len(self.model.layers) - 1
        for i, (layer, full, kv_cache) in enumerate(zip(
            self.model.layers, self._full_attention_layers, kv_caches, strict=True
        )):
            h, layer_scores = layer(h, cos, sin, kv_cache, full_meta if full else meta, rows if i == last else None)
            if scores is not None:
                scores.append(layer_scores)  # type: ignore[arg-type]
        return self.model.norm(h), scores

    def compute_logits(
        self, hidden: torch.Tensor  # [n, hidden_size]
    ) -> torch.Tensor:  # [n, vocab_size] float32
        if f32_blocks.supports(hidden, self.lm_head_weight):  # 8-64 float32 rows: register tiles
            return f32_blocks.f32_block_linear(hidden, self.lm_head_weight)
        if native_gemv.supports(hidden, self.lm_head_weight):  # the sampled rows, one weight pass
            return native_gemv.gemv_float(hidden, self.lm_head_weight)
        return linear(hidden, self.lm_head_weight).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full Hugging Face tensors (``model.layers.N.self_attn.q_proj.weight``, ...) into
        this rank's shards; raises if any parameter is left unloaded or a name is unknown."""
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._load_one(name, tensor)
            if target:
                loaded.add(target)
        missing = sorted(set(self._expected_targets()) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        self._settle_layout()

    def _settle_layout(self) -> None:
        """After loading: column-major weights where the native kernels are not built (torch's
        GEMV streams that layout faster), else row-major stays (the native kernels stream it
        best: docs/engine.md, "Native CPU decode") and the native decode step is gathered.
        CPU weights move to huge pages first (kernels/huge_pages.py: every step streams them)."""
        if self.model.embed_tokens.weight.device.type == "cpu":
            huge_pages.rehome_parameters(self)
        if native_library() is None:
            use_cpu_gemv_layout(self)
        self._native_decode = self._build_native_decode()

    def _build_native_decode(self) -> NativeDecodeStack | None:
        """The native decode step over this model's weights, where it applies (CPU, float32 or
        bfloat16, no tensor parallelism, native kernels built); None otherwise."""
        embed = self.model.embed_tokens.weight
        if (
            self.tp.size != 1
            or embed.device.type != "cpu"
            or self.dtype not in native_gemv.WEIGHT_DTYPES
            or native_library() is None
        ):
            return None
        layers = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(LayerWeights(
                attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight, attn.o_proj.bias,
                mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, mlp.down_proj.weight,
                mlp.down_proj.bias, layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight, layer.sliding_window is not None,
            ))
        rotary = self.model.rotary
        try:
            return NativeDecodeStack(
                layers, embed, self.model.norm.weight, rotary.cos_table, rotary.sin_table,
                self.config.num_attention_heads, self.num_kv_heads, self.config.head_dim,
                self.config.rms_norm_eps,
            )
        except ValueError:  # a layout the kernel does not read (e.g. column-major weights)
            return None

    _LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
    _QKV = {"self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v"}
    _GATE_UP = {"mlp.gate_proj": 0, "mlp.up_proj": 1}

    def _load_one(self, name: str, tensor: torch.Tensor) -> str | None:
        """Load one HF tensor; returns a key naming what it filled (for the missing check). A
        tensor whose shape does not fit the model its config describes names itself (torch's
        own message names neither the weight nor the file)."""
        try:
            return self._load_tensor(name, tensor)
        except RuntimeError as e:
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, which does not fit the model "
                f"config.json describes (hidden_size {self.config.hidden_size}, "
                f"{self.config.num_attention_heads} heads of {self.config.head_dim}, "
                f"{self.config.num_key_value_heads} kv heads, intermediate_size "
                f"{self.config.intermediate_size}, vocab_size {self.config.vocab_size}): {e}"
            ) from e

    def _load_tensor(self, name: str, tensor: torch.Tensor) -> str | None:
        if name.endswith("rotary_emb.inv_freq"):
            return None  # old checkpoints store the RoPE buffer; we recompute it
        m = self.model
        if name == "model.embed_tokens.weight":
            m.embed_tokens.weight.copy_(tensor)
            return name
        if name == "model.norm.weight":
            m.norm.weight.copy_(tensor)
            return name
        if name == "lm_head.weight":
            if self.config.tie_word_embeddings:
                return None  # some tied checkpoints store a copy of the embedding
            self.lm_head_weight.copy_(tensor)
            return name
        match = self._LAYER.match(name)
        if match is None:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        idx, module, kind = int(match[1]), match[2], match[3]
        if idx >= len(m.layers):
            raise ValueError(f"checkpoint has layer {idx} but config has {len(m.layers)} layers")
        layer = m.layers[idx]
        is_bias = kind == "bias"
        if module in self._QKV:
            layer.self_attn.qkv_proj.load_shard(self._QKV[module], tensor, is_bias)
        elif module in self._GATE_UP:
            layer.mlp.gate_up_proj.load_shard(self._GATE_UP[module], tensor, is_bias)
        elif module == "self_attn.o_proj":
            layer.self_attn.o_proj.load_shard(tensor, is_bias)
        elif module == "mlp.down_proj":
            layer.mlp.down_proj.load_shard(tensor, is_bias)
        elif module in ("input_layernorm", "post_attention_layernorm") and not is_bias:
            getattr(layer, module).weight.copy_(tensor)
        else:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        return name

    def _expected_targets(self) -> list[str]:
        c = self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not c.tie_word_embeddings:
            names.append("lm_head.weight")
        per_layer = [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ]
        if c.qkv_bias:
            per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        if c.o_bias:
            per_layer.append("self_attn.o_proj.bias")
        if c.mlp_bias:
            per_layer += ["mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias"]
        return names + [f"model.layers.{i}.{p}" for i in range(c.num_hidden_layers) for p in per_layer]
