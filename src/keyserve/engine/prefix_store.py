"""The prefix store in the engine: where its KV comes from and where loaded KV goes.

Wiring (in-process engine only): the device tier is a set of blocks reserved from the engine's
KV pool; a sequence about to lose its blocks (finished, aborted, preempted) with exact KV is
stored from those blocks (``BlockManager.on_free``); a prompt under a KV budget is stored with
the attention scores its policy accumulated, just before prompt-phase eviction compacts it
(``KVCore.prefix_hook``); and a sequence being admitted gets the longest stored prefix loaded
into fresh blocks instead of recomputed (``Scheduler.prefix_loader``) -- every token under the
full policy, only the important chunks and the request's recent window under a KV budget, at
their original positions.
Storing is split: the KV is copied out of the blocks at once, and stored (importance,
repacking, tiers, the disk write) at ``flush``, which the engine calls before its next step
and when it goes idle. A load's promotions (counting the access, moving chunks to faster
tiers) wait for that flush too, so neither delays the first token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from keyserve.config import PrefixStoreConfig
from keyserve.core.block_pool import KVBlock
from keyserve.core.prefix_store import (
    BlockPoolChunks,
    DiskTier,
    HostChunks,
    KVLayout,
    LoadedPrefix,
    PrefixStore,
    StoreSettings,
)
from keyserve.core.sequence import Sequence


@dataclass
class _PendingInsert:
    tokens: list[int]
    start: int  # the first position ``kv`` holds
    kv: torch.Tensor  # [L, aligned(len(tokens)) - start, 2, H, D], copied from the blocks
    scores: torch.Tensor | None  # [L, H, >= len(tokens)]


class EnginePrefixStore:
    def __init__(self, config: PrefixStoreConfig, core: object, runner: object) -> None:
        self.config = config
        self.core = core
        self.runner = runner
        bm = core.block_manager  # type: ignore[attr-defined]
        self.bm = bm
        self.block_size = bm.block_size
        kv = runner.kv_caches  # type: ignore[attr-defined]
        self.kv_caches = kv
        chunk = config.chunk_size or self.block_size
        if chunk % self.block_size:
            raise ValueError(f"prefix store chunk_size {chunk} is not a multiple of block_size")
        num_layers = len(kv)
        _, _, heads, dim = kv[0][0].shape
        dtype = kv[0][0].dtype
        shape = (2, chunk, heads, dim)
        reserve = (config.device_tokens // chunk) * (chunk // self.block_size)
        if reserve >= bm.num_blocks:
            raise ValueError(f"prefix store device tier ({reserve} blocks) must leave KV blocks free "
                             f"(the pool has {bm.num_blocks})")
        # Reserved blocks hold one reference forever: the scheduler never sees them free.
        self.reserved = [bm.pool.allocate().block_id for _ in range(reserve)]
        device = BlockPoolChunks(kv, self.reserved, chunk) if reserve else None
        host_slots = config.host_tokens // chunk
        try:
            host = HostChunks(num_layers, host_slots, shape, dtype) if host_slots else None
        except (RuntimeError, MemoryError) as e:  # the allocator's own words name no option
            need = num_layers * host_slots * torch.Size(shape).numel() * dtype.itemsize
            raise ValueError(f"prefix store host tier of {config.host_tokens} tokens needs "
                             f"{need / 2**30:.1f} GiB of host memory, which cannot be allocated "
                             f"(prefix_store_host_tokens): {e}") from None
        low = None if config.disk_unimportant_dtype == "same" else getattr(torch, config.disk_unimportant_dtype)
        disk = DiskTier(config.disk_path, int(config.disk_max_gb * (1 << 30)), shape, dtype,
                        config.disk_cold_reads, low_dtype=low)
        settings = StoreSettings(
            chunk, config.top_k_fraction, config.importance_heads, config.check_agreement,
            config.repack, config.eviction, defer_promotions=True,
        )
        self.store = PrefixStore(settings, KVLayout(num_layers, heads, dim, dtype), disk, device, host)
        self._loaded: set[int] = set()  # seq_ids whose blocks came from a load this admission
        self._quiet: set[int] = set()  # seq_ids being undone: do not store them on free
        self._pending: list[_PendingInsert] = []  # copied out, stored at the next flush
        # seq_id -> its scores when its computed prompt reached ``score_boundary`` (queries
        # before the boundary only: those a request loading the prefix does not recompute)
        self._boundary_scores: dict[int, torch.Tensor] = {}
        bm.on_free = self.on_free
        core.scheduler.prefix_loader = self  # type: ignore[attr-defined]
        core.prefix_hook = self  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ paged KV I/O
    def _physical(
        self,
        table: list[int],
        slots: torch.Tensor,  # [n] int64 logical slots
    ) -> torch.Tensor:  # [n] int64 physical slots
        t = torch.tensor(table, dtype=torch.int64)
        return t[slots // self.block_size] * self.block_size + slots % self.block_size

    def _gather(self, table: list[int], start: int, end: int) -> torch.Tensor:  # [L, T, 2, H, D]
        """KV of positions [start, end) of a sequence whose slot i holds position i."""
        phys = self._physical(table, torch.arange(start, end)).to(self.kv_caches[0][0].device)
        out = []
        for k, v in self.kv_caches:
            rows_k = k.view(-1, *k.shape[2:])[phys]
            rows_v = v.view(-1, *v.shape[2:])[phys]
            out.append(torch.stack([rows_k, rows_v], dim=1))
        return torch.stack(out).cpu()

    def _scatter(self, table: list[int], loaded: LoadedPrefix, slots: torch.Tensor) -> None:
        """Write the loaded KV into logical ``slots`` ([L, C]: per layer, -1 = nothing) of
        the table. As in ``LoadedPrefix``, -1 pads only a layer's tail, so each layer's rows
        are a slice (no masked copy)."""
        dev = self.kv_caches[0][0].device
        counts = (slots >= 0).sum(1).tolist()
        for layer, (k, v) in enumerate(self.kv_caches):
            n = counts[layer]
            phys = self._physical(table, slots[layer, :n]).to(dev)
            data = loaded.kv[layer, :n].to(dev, k.dtype)  # [c_l, 2, H, D]
            k.view(-1, *k.shape[2:])[phys] = data[:, 0]
            v.view(-1, *v.shape[2:])[phys] = data[:, 1]

    # ------------------------------------------------------------------ storing
    def on_free(self, seq: Sequence) -> None:
        """A sequence is about to release its blocks: store its exact, computed prefix."""
        if seq.seq_id in self._quiet:
            return
        if not seq.prefix_cacheable:
            if seq.kv_budgeted and seq.kv_slot_cap is None:  # ended before its prompt was compacted
                self.on_prompt_computed(seq)
            return  # a compressed (KV-budget) cache never holds a whole prefix
        computed = min(seq.num_computed_tokens, len(seq.block_table) * self.block_size)
        if computed < self.store.chunk:
            return
        self._defer(seq.token_ids[:computed], list(seq.block_table), None)

    def score_boundary(self, seq: Sequence) -> int | None:
        """Where a prompt scored by attention has its scores kept apart (``Scheduler``): the end
        of its last whole chunk, the length it is stored at. The scores stored with a prefix
        must hold the attention of the queries before that end only: a request that loads the
        prefix computes the rest itself and adds its own (the stored prompt's tail counted
        again, else). A step crossing it runs the two sides as two attention rows
        (``StepItem.score_split``), so the boundary costs no forward of its own."""
        kv_budget = seq.kv_budget
        if kv_budget is None or not kv_budget.by_score or kv_budget.last_query_only:
            return None
        if seq.kv_slot_cap is not None:  # compacted: its prompt phase is over
            return None
        end = self.store.tree.aligned(seq.num_tokens)
        return end if self.store.chunk <= end < seq.num_tokens else None

    def on_computed(self, seq: Sequence) -> None:
        """A step was committed: keep the scores of a prompt as of its ``score_boundary`` (before
        the rest of the prompt adds its queries' attention), when the step crossed it (the
        runner kept them apart) or ended on it."""
        budget = self.runner.budget  # type: ignore[attr-defined]
        crossed = budget.boundary_scores.pop(seq.seq_id, None)  # [L, H, boundary]
        end = self.score_boundary(seq)
        state = budget.get(seq)
        if end is None or state is None:
            return
        if crossed is not None and crossed.shape[-1] == end:
            scores = crossed
        elif seq.num_computed_tokens == end and state.num_slots == end:
            scores = state.scores[..., :end]
        else:
            return
        if not bool((state.positions[..., :end] == torch.arange(end, device=state.device)).all()):
            return
        self._boundary_scores[seq.seq_id] = scores.float().cpu().clone()

    def on_prompt_computed(self, seq: Sequence) -> None:
        """A budgeted prompt is computed (or its sequence ends first) and not yet compacted:
        store it with the attention scores its policy accumulated (the importance), if its KV
        is exact."""
        boundary = self._boundary_scores.pop(seq.seq_id, None)
        state = self.runner.budget.get(seq)  # type: ignore[attr-defined]
        if state is None or seq.num_computed_tokens < self.store.chunk:
            return
        if boundary is not None and state.kv_budget.by_score:
            end = boundary.shape[-1]
            self._defer(seq.token_ids[:end], list(seq.block_table), boundary)
            return
        n = state.num_slots
        if n != seq.num_computed_tokens or n > len(seq.block_table) * self.block_size:
            return
        if not bool((state.positions == torch.arange(n, device=state.device)).all()):
            return  # loaded with tokens dropped: its later KV is approximate, never stored
        # A copy: ``state.scores`` is a view that compaction and later steps rewrite.
        scores = state.scores.float().cpu().clone() if state.kv_budget.by_score else None
        self._defer(seq.token_ids[:n], list(seq.block_table), scores)

    def _defer(
        self,
        tokens: list[int],
        table: list[int],
        scores: torch.Tensor | None,  # [L, H, >= len(tokens)] accumulated attention
    ) -> None:
        """Copy out now the KV an insert would read (the blocks are about to be freed or
        compacted); store it at ``flush``, after the step has returned its tokens, so storing
        delays neither this request's first token nor anyone's current one."""
        t0 = time.perf_counter()
        start = self.store.first_unstored(tokens, scores is not None)
        end = self.store.tree.aligned(len(tokens))
        if start < end:
            self._pending.append(_PendingInsert(tokens, start, self._gather(table, start, end), scores))
        self.store.stats.insert_seconds += time.perf_counter() - t0

    @property
    def pending_tokens(self) -> int:
        """Tokens copied out of blocks and not yet stored."""
        return sum(p.kv.shape[1] for p in self._pending)

    @torch.inference_mode()
    def flush(self) -> None:
        """Store what the last steps copied out, oldest first. A copy that no longer covers
        what the insert would read (an earlier insert evicted part of its path) is dropped."""
        self.store.settle()  # the last loads' promotions, before inserts may re-lay nodes out
        pending, self._pending = self._pending, []
        for p in pending:
            if self.store.first_unstored(p.tokens, p.scores is not None) < p.start:
                self.store.stats.dropped_inserts += 1
                continue
            kv, start = p.kv, p.start
            self.store.insert(p.tokens, lambda a, b: kv[:, a - start : b - start], p.scores)

    # ------------------------------------------------------------------ loading
    def load(self, seq: Sequence, cached: list[KVBlock], token_budget: int) -> list[KVBlock]:
        """Attach the longest stored prefix beyond the pool's own hit ``cached``; returns the
        pool blocks the scheduler should still attach (none once a load took them)."""
        self._loaded.discard(seq.seq_id)
        if seq.block_table or seq.num_computed_tokens or seq.params.prompt_logprobs is not None:
            return cached
        bs = self.block_size
        start = len(cached) * bs
        max_tokens = seq.num_tokens - 1  # at least one token is computed, for the logits
        tokens = seq.token_ids
        self.store.stats.lookups += 1
        need_scores = self._needs_scores(seq)
        exact = seq.kv_budget is None  # the full policy: never KV the disk tier rounded
        m = self.store.match_length(tokens, max_tokens, need_scores, exact)
        if m <= start:
            return cached
        # Load only if the whole first step fits now (else the normal path decides).
        first = min(seq.num_tokens - m, token_budget)
        revived = sum(1 for b in cached if b.ref_cnt == 0)
        if self.bm.blocks_for_slots(m + first) - len(cached) > self.bm.num_free_blocks - revived:
            return cached
        # important tokens are chosen by attention score: only score-driven policies load them
        important = need_scores and self.config.load_important_only
        floor = self._tokens_per_layer_floor(seq, m) if important else 0
        recent = self._recent_from(seq) if important else None
        loaded = self.store.load(tokens, max_tokens, start, important, need_scores, floor, recent, exact)
        if loaded is None or loaded.num_tokens <= start:
            return cached
        m = loaded.num_tokens
        pool = self.bm.pool
        for block in cached:
            pool.acquire(block)
            seq.block_table.append(block.block_id)
        while len(seq.block_table) < m // bs:
            seq.block_table.append(pool.allocate().block_id)
        self.bm.prefix_hits += start
        if seq.kv_budgeted:
            # layer l's tokens go to slots 0..c_l-1; the suffix continues from c_l in that layer
            packed = torch.arange(loaded.positions.shape[1]).expand_as(loaded.positions)
            self._scatter(seq.block_table, loaded, torch.where(loaded.positions >= 0, packed, -1))
            self._start_budget(seq, loaded)
        else:
            self._scatter(seq.block_table, loaded, loaded.positions)
        seq.num_computed_tokens = m
        seq.num_cached_tokens = m
        self._loaded.add(seq.seq_id)
        return []

    def _tokens_per_layer_floor(self, seq: Sequence, m: int) -> int | None:
        """Fewest prefix tokens a layer may load (all of them before a longer rest of the
        prompt). Layers may load different counts only until prompt-phase eviction evens them
        out at k (decode takes one context length per sequence), so the loaded tokens plus the
        rest of the sequence must reach k in every layer. With k at least the whole sequence nothing is evicted: None, every layer loads
        the same count."""
        rest = seq.num_tokens - m
        if rest >= m:
            # A prefix shorter than what follows (a shared system prompt before a new document)
            # loads whole: the prompt computed after it stays exact and can itself be stored.
            return m
        kv_budget = seq.kv_budget
        if kv_budget is None or kv_budget.budget is None or kv_budget.budget >= seq.num_tokens:
            return None
        return min(m, max(0, kv_budget.budget - rest))

    def _recent_from(self, seq: Sequence) -> int | None:
        """The first position of the recent window prompt-phase eviction will protect: H2O and
        Keyformer keep those tokens whatever their scores, so an importance load brings them
        too (without them the window holds only the important few, and the question reads a
        prefix whose last part is half gone)."""
        kv_budget = seq.kv_budget
        if kv_budget is None or kv_budget.budget is None:
            return None
        return seq.num_tokens - kv_budget.num_recent

    def _needs_scores(self, seq: Sequence) -> bool:
        """H2O / Keyformer evict by accumulated scores: a prefix stored without them is
        recomputed (and stored again with them) rather than loaded with none."""
        return seq.kv_budget is not None and seq.kv_budget.by_score

    def _start_budget(self, seq: Sequence, loaded: LoadedPrefix) -> None:
        """The runner's KV-budget state starts from the loaded tokens (original positions, the
        scores stored with them) instead of an empty prompt phase."""
        kv_budget = seq.kv_budget
        assert kv_budget is not None
        tracker = self.runner.budget  # type: ignore[attr-defined]
        state = tracker.start(seq, kv_budget)
        L, C = loaded.positions.shape
        heads = tracker.num_kv_heads
        scores = loaded.scores if loaded.scores is not None else torch.zeros(L, heads, C)
        state.restore(loaded.positions[:, None, :].expand(L, heads, C), scores, loaded.num_tokens)

    def unload(self, seq: Sequence) -> None:
        """The scheduler could not admit a sequence after all: give the loaded blocks back."""
        if seq.seq_id not in self._loaded:
            return
        self._loaded.discard(seq.seq_id)
        self._boundary_scores.pop(seq.seq_id, None)
        self._quiet.add(seq.seq_id)
        try:
            self.bm.free(seq)
        finally:
            self._quiet.discard(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        if seq.kv_budgeted:
            self.runner.budget.release(seq)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, float]:
        return self.store.sync_stats().to_dict()

    def close(self) -> None:
        self._pending.clear()
        self.store.close()
