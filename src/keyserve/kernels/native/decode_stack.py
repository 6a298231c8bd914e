"""torch-facing wrapper of the one-call native decode step (``decode_stack.c``).

The model gathers its weight pointers once (``NativeDecodeStack(...)`` after loading); each
decode-only step is then one ``ctypes`` call that runs every layer -- no Python, no tensor
construction per layer. Steps it does not take (prefill or mixed rows, KV-budget scores,
more rows than ``max_rows`` allows, autograd) stay on the model's torch path. Where the build
has them, the layers' weights are also packed for the step's products of several rows: AMX
tiles for bf16 (``amx.py``, from 2 rows), float32 register tiles (``f32_block.c``, from 2).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from keyserve.core.thread_governor import ThreadGovernor
from keyserve.kernels import checks, huge_pages
from keyserve.kernels.metadata import AttentionMetadata
from keyserve.kernels.native import amx, env_switch, f32_blocks, require_library
from keyserve.kernels.native.gemv import MAX_ROWS, WEIGHT_DTYPES

_CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# The most decode rows a step takes natively, by weight dtype, from bench/decode_rows_bench.py
# (BENCHMARKS.md "decode_rows", AMX Xeon, 2 threads, 512-token contexts): float32's native step
# beat the torch path at every row count measured (1.26x at 16 rows, 1.06x at 64); in bf16 the
# vector kernels lose to the torch path's oneDNN GEMMs (AMX) from 24 rows (0.91x) on, so bf16
# goes to 64 rows only where the step runs its own products on AMX tiles (amx_linear.c).
ROW_LIMITS = {torch.float32: 64, torch.bfloat16: MAX_ROWS}
AMX_MAX_ROWS = amx.MAX_ROWS
_ERRORS = {
    1: (IndexError, "input_ids: a token id is outside the vocabulary"),
    2: (IndexError, "positions: a position is outside the rotary table (max_position_embeddings)"),
    3: (IndexError, "slot_mapping: a slot is outside the KV cache"),
    4: (IndexError, "decode_block_tables/context_lens: a block is outside the KV cache"),
    5: (MemoryError, "native decode: out of memory for the step's scratch buffers"),
}
_FIELDS = 17  # per-layer pointer fields, decode_stack.c's LAYER_FIELDS
_K_CACHE, _V_CACHE, _SLIDING = 10, 11, 12


@dataclass
class LayerWeights:
    """One decoder layer's tensors, each row-major contiguous in the model's dtype."""

    qkv_w: torch.Tensor  # [(hq + 2 hkv) * d, hidden]
    qkv_b: torch.Tensor | None  # [(hq + 2 hkv) * d]
    o_w: torch.Tensor  # [hidden, hq * d]
    o_b: torch.Tensor | None  # [hidden]
    gate_up_w: torch.Tensor  # [2 * inter, hidden]: gate rows, then up rows
    gate_up_b: torch.Tensor | None  # [2 * inter]
    down_w: torch.Tensor  # [hidden, inter]
    down_b: torch.Tensor | None  # [hidden]
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    sliding: bool  # the layer uses the step's sliding window


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class NativeDecodeStack:
    """A model's weights as the native decode step sees them (pointers gathered once)."""

    def __init__(
        self,
        layers: list[LayerWeights],
        embed: torch.Tensor,  # [vocab, hidden], any strides
        final_norm: torch.Tensor,  # [hidden]
        cos_table: torch.Tensor,  # [max_pos, head_dim // 2] float32 (rotary scaling included)
        sin_table: torch.Tensor,  # [max_pos, head_dim // 2] float32
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
    ) -> None:
        dtype = embed.dtype
        if dtype not in WEIGHT_DTYPES:
            raise ValueError(f"native decode needs float32 or bfloat16 weights, got {dtype}")
        vocab, hidden = embed.shape
        inter = layers[0].down_w.shape[1]
        for lw in layers:
            for name in ("qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "gate_up_b", "down_w",
                         "down_b", "input_norm", "post_norm"):
                t = getattr(lw, name)
                if t is not None and (t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu"):
                    raise ValueError(f"native decode: {name} must be a contiguous CPU {dtype} tensor")
        if cos_table.dtype != torch.float32 or not cos_table.is_contiguous() or not sin_table.is_contiguous():
            raise ValueError("native decode: cos/sin tables must be contiguous float32")
        self.dtype, self.hidden, self.num_kv_heads, self.head_dim = dtype, hidden, num_kv_heads, head_dim
        self.num_layers = len(layers)
        self._keep = (layers, embed, final_norm, cos_table, sin_table)  # pointers stay valid
        packed = _amx_packed(layers) if dtype == torch.bfloat16 else _f32_packed(layers, hidden, inter)
        self._packed = packed  # kept alive: the table holds their pointers
        self._table = torch.tensor(
            [[_ptr(lw.qkv_w), _ptr(lw.qkv_b), _ptr(lw.o_w), _ptr(lw.o_b), _ptr(lw.gate_up_w),
              _ptr(lw.gate_up_b), _ptr(lw.down_w), _ptr(lw.down_b), _ptr(lw.input_norm),
              _ptr(lw.post_norm), 0, 0, int(lw.sliding)] + [_ptr(t) for t in (packed[i] if packed else [None] * 4)]
             for i, lw in enumerate(layers)],
            dtype=torch.int64,
        ).view(len(layers), _FIELDS)
        self._dims = torch.tensor(
            [hidden, inter, num_heads, num_kv_heads, head_dim, len(layers), WEIGHT_DTYPES[dtype],
             0, 0, 0, vocab, cos_table.shape[0], embed.stride(0), embed.stride(1)],
            dtype=torch.int64,
        )
        self._eps, self._scale = float(eps), float(head_dim**-0.5)
        self._caches_key: tuple[int, int, int] | None = None
        self._sliding = [lw.sliding for lw in layers]
        self.weight_ptr = layers[0].qkv_w.data_ptr()  # the model checks its weights are these
        # all of torch's threads or one, by measurement (CPU contention: core/thread_governor.py);
        # the result is the same bits either way (each output row is one thread's work)
        # KEYSERVE_THREAD_GOVERNOR=0 pins the step to torch's thread count
        self.governor = ThreadGovernor() if env_switch("KEYSERVE_THREAD_GOVERNOR") else None
        # the most rows a step takes here; more go to the torch path (bench/decode_rows_bench.py
        # measures where each side wins)
        self.max_rows = AMX_MAX_ROWS if packed and dtype == torch.bfloat16 else ROW_LIMITS[dtype]

    def takes(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
    ) -> bool:
        """True for a step this kernel runs: decode rows only, no scores, few enough rows (tree
        verification rows included: every layer applies ``meta.decode_tree_masks``)."""
        n = input_ids.shape[0]
        return (
            meta.score_mode is None
            and meta.num_decode_seqs == n
            and 1 <= n <= self.max_rows
            and meta.prefill_block_tables.shape[0] == 0
            and input_ids.device.type == "cpu"
            and not torch.is_grad_enabled()
        )

    def _bind_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Write the caches' pointers into the layer table (once per cache list); False where
        the caches are not ones this kernel reads (another dtype, not contiguous)."""
        key = (id(kv_caches), kv_caches[0][0].data_ptr(), kv_caches[-1][1].data_ptr())
        if key == self._caches_key:
            return True
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for {self.num_layers} layers")
        k0 = kv_caches[0][0]
        shape = tuple(k0.shape)
        if k0.dtype not in _CACHE_DTYPES or shape[2:] != (self.num_kv_heads, self.head_dim):
            return False
        for k, v in kv_caches:
            for t in (k, v):
                if tuple(t.shape) != shape or t.dtype != k0.dtype or not t.is_contiguous() or t.device.type != "cpu":
                    return False
        for i, (k, v) in enumerate(kv_caches):
            self._table[i, _K_CACHE] = k.data_ptr()
            self._table[i, _V_CACHE] = v.data_ptr()
        self._dims[7] = _CACHE_DTYPES[k0.dtype]
        self._dims[8] = shape[1]  # block size
        self._dims[9] = shape[0]  # blocks
        self._caches_key = key
        return True

    def run(
        self,
        input_ids: torch.Tensor,  # [m] int64
        positions: torch.Tensor,  # [m] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer [blocks, B, hkv, d] each
        meta: AttentionMetadata,
        sliding: list[bool] | None = None,  # [layers]: which layers take the window (default: as built)
    ) -> torch.Tensor | None:  # [m, hidden] final hidden states (after the last norm), model dtype
        """One decode step through every layer; writes this step's K/V into the caches. None
        (nothing done) where the caches are not float32/bf16 contiguous CPU tensors."""
        lib = require_library()
        if not self._bind_caches(kv_caches):
            return None
        if sliding is not None and sliding != self._sliding:
            if len(sliding) != self.num_layers:
                raise ValueError(f"sliding: {len(sliding)} flags for {self.num_layers} layers")
            self._table[:, _SLIDING] = torch.tensor(sliding, dtype=torch.int64)
            self._sliding = list(sliding)
        m = input_ids.shape[0]
        ids = _as(input_ids, torch.int64)
        pos = _as(positions, torch.int64)
        slots = _as(meta.slot_mapping, torch.int64)
        if slots.dim() == 1:
            strides = (0, 1, 0)
        elif slots.dim() == 3 and tuple(slots.shape) == (self.num_layers, m, self.num_kv_heads):
            strides = (m * self.num_kv_heads, self.num_kv_heads, 1)
        else:
            raise ValueError(f"slot_mapping: expected [{m}] or [layers, {m}, kv_heads], got {tuple(slots.shape)}")
        if slots.shape[-2 if slots.dim() == 3 else 0] != m:
            raise ValueError(f"slot_mapping has {slots.shape} rows for {m} tokens")
        tables = _as(meta.decode_block_tables, torch.int32)
        lens = _as(meta.decode_context_lens, torch.int32)
        if tables.shape[0] != m or lens.shape[-1] != m or (lens.dim() == 2 and lens.shape[0] != self.num_layers):
            raise ValueError("decode_block_tables/decode_context_lens do not match the step's rows")
        # tree speculation's rows: every layer applies the row's mask (read by raw row index)
        masks = checks.check_tree_masks(meta.decode_tree_masks, m, input_ids.device)
        out = torch.empty(m, self.hidden, dtype=self.dtype)
        _, embed, final_norm, cos_table, sin_table = self._keep
        full = torch.get_num_threads()
        threads = self.governor.choose(full, m) if self.governor else full
        start = time.perf_counter()
        rc = lib.keyserve_decode_stack(
            self._dims.data_ptr(), self._eps, self._scale, self._table.data_ptr(),
            embed.data_ptr(), final_norm.data_ptr(), cos_table.data_ptr(), sin_table.data_ptr(),
            m, ids.data_ptr(), pos.data_ptr(), slots.data_ptr(), *strides, tables.data_ptr(),
            tables.shape[1], lens.data_ptr(), m if lens.dim() == 2 else 0,
            meta.sliding_window or 0, out.data_ptr(), threads, _ptr(masks),
        )
        if self.governor:
            self.governor.record(full, m, threads, time.perf_counter() - start)
        if rc:
            exc, message = _ERRORS.get(rc, (RuntimeError, f"native decode failed ({rc})"))
            raise exc(message)
        return out


def _amx_packed(layers: list[LayerWeights]) -> list[list[torch.Tensor]] | None:
    """Each layer's four bf16 weight matrices in AMX tiles (qkv, o, gate_up, down; amx.py's
    cache, shared with the model's own products), or None where the step cannot use them: no
    AMX (CPU, compiler, kernel permission or ``KEYSERVE_AMX=0``), or a matrix the tiles do not
    divide."""
    if not amx.available():
        return None
    mats = [[lw.qkv_w, lw.o_w, lw.gate_up_w, lw.down_w] for lw in layers]
    if not all(amx.packable(w) for row in mats for w in row):
        return None
    return [[amx.packed_weight(w) for w in row] for row in mats]


def _f32_packed(layers: list[LayerWeights], hidden: int, inter: int) -> list[list[torch.Tensor]] | None:
    """Each layer's four float32 weight matrices packed for f32_block.c's register tiles (32
    outputs per block, input-major), or None where the step cannot use them: no AVX-512 build,
    outputs the 32-column blocks do not divide, or ``KEYSERVE_F32_BLOCKS=0``. A second copy of
    the layers' float32 weights (SmolLM2: 430 MB)."""
    if not f32_blocks.available():
        return None
    if hidden % 32 or inter % 32 or any(lw.qkv_w.shape[0] % 32 for lw in layers):
        return None
    mats = [(lw.qkv_w, lw.o_w, lw.gate_up_w, lw.down_w) for lw in layers]
    buffers = iter(huge_pages.carve(4 * w.numel() for row in mats for w in row))  # streamed every step
    return [[f32_blocks.pack_into(w, next(buffers)) for w in row] for row in mats]


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor of ``dtype``, without a copy when it already is one."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()
