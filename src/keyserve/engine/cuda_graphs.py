"""CUDA graphs for decode steps: one replay instead of hundreds of kernel launches from Python.

On a GPU a SmolLM2-sized batch-1 decode step is ~1.5 ms of kernels but took ~36 ms of host
time launching them (H100 profile in docs/BENCHMARKS.md, "The engine on a GPU"): ~15 launches
per layer, each through torch's dispatcher or Triton's Python launcher. As vLLM and SGLang do,
each padded batch size ("bucket") gets one graph of the whole forward and the LM head,
recorded on static input buffers the first time a step of that size runs; later steps copy
their inputs into the buffers and replay it.

Which steps: every query token a decode row (plain decode, or speculative verification's
K + 1 rows per sequence), no attention scores (KV budgets that score stay eager), one slot
per token in every layer, and at most ``max_rows`` rows. Padding rows write nowhere (slot -1)
and attend to one slot of a valid block; their logits are never read. Tensor parallelism
stays eager (its all-reduce is gloo or NCCL called from Python).

The first run of a bucket is also a real run of that step (it warms Triton's compiler before
recording); the replay that follows writes the same K/V to the same slots, so it is
idempotent. A bucket whose recording fails runs eagerly from then on, with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from keyserve.kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)

# model(input_ids, positions, kv_caches, meta) -> (hidden [n, hidden], scores)
ForwardFn = Callable[..., tuple[torch.Tensor, object]]


def bucket_for(num_rows: int, max_rows: int) -> int | None:
    """The smallest bucket holding ``num_rows`` rows, or None past ``max_rows``."""
    for b in BUCKETS:
        if b > max_rows:
            break
        if b >= num_rows:
            return b
    return None


def graphable(meta: AttentionMetadata, num_tokens: int, max_blocks: int) -> bool:
    """A step the graphs can run: decode rows only, no scores, no tree masks (the captured
    graphs have no buffer for them: tree verification steps run eagerly), 1-D slots and context
    lengths, block tables no wider than the static buffer."""
    return (
        meta.num_prefill_seqs == 0
        and meta.num_decode_seqs == num_tokens > 0
        and meta.score_mode is None
        and meta.noise_keys is None
        and meta.decode_tree_masks is None
        and meta.slot_mapping.dim() == 1
        and meta.decode_context_lens.dim() == 1
        and meta.decode_block_tables.shape[1] <= max_blocks
    )


class DecodeGraphs:
    """Per-bucket CUDA graphs of ``logits_fn(model(...))`` over static inputs (one runner's)."""

    def __init__(
        self,
        model: ForwardFn,
        logits_fn: Callable[[torch.Tensor], torch.Tensor | None],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_blocks: int,
        max_rows: int,
        device: torch.device,
        sliding_window: int | None,
    ) -> None:
        self.model, self.logits_fn, self.kv_caches = model, logits_fn, kv_caches
        self.max_blocks, self.max_rows, self.sliding_window = max_blocks, max_rows, sliding_window
        rows = bucket_for(max_rows, max_rows) or max_rows
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(rows, **i64)  # [rows]
        self.positions = torch.zeros(rows, **i64)  # [rows]
        self.slots = torch.full((rows,), -1, **i64)  # [rows]; -1: write nothing
        self.tables = torch.zeros(rows, max_blocks, dtype=torch.int32, device=device)  # [rows, max_blocks]
        self.context_lens = torch.ones(rows, dtype=torch.int32, device=device)  # [rows]
        self._no_prefill = (torch.zeros(0, max_blocks, dtype=torch.int32, device=device),
                            torch.zeros(1, dtype=torch.int32, device=device),
                            torch.zeros(0, dtype=torch.int32, device=device))
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}  # bucket -> (replay, logits)
        self.eager: set[int] = set()  # buckets whose recording failed
        self._pool = None

    def takes(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        n = int(input_ids.shape[0])
        b = bucket_for(n, self.max_rows)
        return b is not None and b not in self.eager and graphable(meta, n, self.max_blocks)

    def run(
        self,
        input_ids: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:  # [n, vocab] float32 logits of every row; None: run it eagerly
        n = int(input_ids.shape[0])
        b = bucket_for(n, self.max_rows)
        assert b is not None
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.tables[:n, :width].copy_(meta.decode_block_tables)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        if b > n:  # padding rows: no write, one slot of a valid block, position 0
            self.slots[n:b].fill_(-1)
            self.context_lens[n:b].fill_(1)
            self.tables[n:b, 0].fill_(0)
            self.positions[n:b].fill_(0)
        entry = self.graphs.get(b)
        if entry is None:
            entry = self._record(b)
            if entry is None:
                return None
        replay, logits = entry
        replay()
        return logits[:n]

    def _forward(self, b: int) -> torch.Tensor:
        pre_tables, pre_starts, pre_lens = self._no_prefill
        meta = AttentionMetadata(
            slot_mapping=self.slots[:b], num_decode_seqs=b, decode_block_tables=self.tables[:b],
            decode_context_lens=self.context_lens[:b], prefill_block_tables=pre_tables,
            prefill_query_start_loc=pre_starts, prefill_context_lens=pre_lens,
            sliding_window=self.sliding_window,
        )
        hidden, _ = self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, meta)
        logits = self.logits_fn(hidden)
        assert logits is not None, "graphs run on the driver rank only"
        return logits

    def _record(self, b: int) -> tuple[Callable[[], None], torch.Tensor] | None:
        try:
            entry = self._capture(lambda: self._forward(b))
        except Exception as e:  # noqa: BLE001 - any recording failure: this bucket stays eager
            log.warning("CUDA graph for %d decode rows not recorded (%s: %s); running it eagerly",
                        b, type(e).__name__, e)
            self.eager.add(b)
            return None
        self.graphs[b] = entry
        return entry

    def _capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Warm up on a side stream (a real run of this step: compiles Triton's kernels), then
        record; returns the replay and the static logits it refreshes."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = forward()
        self._pool = graph.pool()
        return graph.replay, logits
