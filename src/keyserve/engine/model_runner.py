"""Executes a StepInput on the model: apply ops, copy blocks, pack tokens, forward, sample.

This is the only place that turns scheduler decisions into tensors. It consumes one
``StepInput`` per step -- the same message whether the runner sits in the engine's process or
is one tensor-parallel shard in a Ray actor -- and knows nothing about requests, stop
conditions or text. Per-sequence state that must persist across steps lives here: sampling
parameters and generators (sampling happens here, on the driver rank), and KV-budget states
(rank-local: each rank holds whole kv-heads, docs/algorithms.md §2) in ``self.budget``; what a
budget does in a step -- its slots, Keyformer's temperature and noise, the scores the attention
returns, compaction -- is in ``engine/kv_budget/``.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from keyserve.core.block_manager import BlockCopy
from keyserve.core.generator_marks import GeneratorMarks
from keyserve.core.sampler import SamplingTensors, make_generator, sample, top_logprobs
from keyserve.core.sampling_params import SamplingParams
from keyserve.core.spec_decode import verify_drafts
from keyserve.core.spec_tree import item_masks, kv_moves, node_depths, verify_tree
from keyserve.engine.cuda_graphs import DecodeGraphs
from keyserve.engine.kv_budget.compaction import apply_compact, apply_settle
from keyserve.engine.kv_budget.pooling import pool_over_layer
from keyserve.engine.kv_budget.replicas import sum_over_replicas
from keyserve.engine.kv_budget.slots import AttentionRows, ScoreRows, SlotPlanner
from keyserve.engine.kv_budget.tracker import KVBudgetTracker
from keyserve.engine.multi_step import decode_on
from keyserve.engine.prompt_logprobs import prompt_logprobs, prompt_rows
from keyserve.engine.step_input import (
    CompactOp,
    ForkOp,
    ReleaseOp,
    RetainOp,
    RunnerOp,
    SeqInfo,
    SettleOp,
    StepInput,
    StepItem,
    StepOutput,
    describe_failure,
)
from keyserve.kernels.metadata import AttentionMetadata

# hidden rows [n, hidden] -> float32 logits [n, vocab] (None on a shard that is not the driver)
LogitsFn = Callable[[torch.Tensor], torch.Tensor | None]


@dataclass
class ModelInputs:
    """One step packed for the forward (the runner's own; never leaves it)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    last_token_index: dict[int, int]  # seq_id -> row of its last query token
    score_rows: list[ScoreRows] = field(default_factory=list)  # budgeted items whose scores come back


def pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """[len(tables), longest] int32 block tables, zero-padded: one tensor built in one call."""
    width = max((len(t) for t in tables), default=0) or 1
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).view(-1, width).to(device)


def _tree_masks(num_rows: int, trees: list[tuple[int, list[int]]], device: torch.device) -> torch.Tensor:
    """[num_rows] int64 decode-row masks (``AttentionMetadata.decode_tree_masks``): -1 (every
    slot visible) but in the rows of tree items."""
    masks = [-1] * num_rows
    for first, rows in trees:
        masks[first : first + len(rows)] = rows
    return torch.tensor(masks, dtype=torch.int64, device=device)


def _slots(table: list[int], start: int, n: int, block_size: int) -> list[int]:
    """Physical slots of positions ``start .. start + n - 1`` of a sequence that keeps every
    token (position p in slot p of its block table)."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        sliding_window: int | None,
        device: torch.device,
        num_layers: int,
        num_kv_heads: int,
        logits_fn: LogitsFn | None = None,
        is_driver: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.device = device
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.budget = KVBudgetTracker(num_layers, num_kv_heads, block_size, device)
        self.logits_fn: LogitsFn = logits_fn or model.compute_logits
        self.is_driver = is_driver  # tensor-parallel rank 0: the one that samples
        self.seq_infos: dict[int, SeqInfo] = {}
        self.generators: dict[int, torch.Generator | None] = {}
        # A step run again (its tokens never reached the engine) draws what it drew before.
        self.generator_marks = GeneratorMarks()
        self.graphs: DecodeGraphs | None = None  # CUDA graphs of decode steps (build_runner sets them)

    # -------------------------------------------------------------- state ops
    def apply_ops(self, ops: list[RunnerOp]) -> dict[int, tuple[int, int]]:
        """Apply the scheduler side's per-sequence decisions; returns budget stats of the
        sequences they changed."""
        changed: dict[int, tuple[int, int]] = {}
        budget = self.budget
        for op in ops:
            if isinstance(op, ForkOp):
                budget.fork(op.parent_id, op.child_id)
            elif isinstance(op, (CompactOp, SettleOp)):
                if isinstance(op, CompactOp):
                    apply_compact(budget, self.kv_caches, op, self.block_size, self.copy_blocks)
                else:
                    apply_settle(budget, self.kv_caches, op, self.block_size)
                stats = budget.stats(op.seq_id)
                if stats is not None:
                    changed[op.seq_id] = stats
            elif isinstance(op, ReleaseOp):
                self.release(op.seq_id)
            elif isinstance(op, RetainOp):
                keep = set(op.seq_ids)
                for seq_id in set(self.seq_infos) | set(budget.states) | set(self.generators):
                    if seq_id not in keep:
                        self.release(seq_id)
        return changed

    def release(self, seq_id: int) -> None:
        self.budget.release_id(seq_id)
        self.seq_infos.pop(seq_id, None)
        self.generators.pop(seq_id, None)
        self.generator_marks.drop(seq_id)

    # ----------------------------------------------------------------- inputs
    def prepare(self, step: StepInput, failed: dict[int, str] | None = None) -> ModelInputs | None:
        """Pack the step's tokens into ``[decode rows | prefill chunks]`` for attention.

        A sequence without a KV budget writes position p to slot p of its block table. A
        budgeted one gets its slots, rows and score requests from ``SlotPlanner``
        (``engine/kv_budget/slots.py``). A target verifying drafts, budgeted or not, contributes
        K + 1 *decode* rows (row i attends to positions ≤ start + i), packed right after the
        decode items: the whole step stays on the decode path (the native decode stack on CPU)
        instead of one prefill attention per sequence and layer.

        ``failed`` (seq_id -> why) collects the budgeted sequences whose own budget could not
        be planned; they are left out of the batch (None if nothing is left to run). Without
        it such an error raises."""
        block, dev = self.block_size, self.device
        n_dec = step.num_decode
        rest = step.items[n_dec:]
        # Verifying targets and short continuations: one decode row per query token. So is a
        # sequence that reserved draft slots but got no drafts this step (prompt lookup found
        # no match): as a one-token prefill chunk it sent the whole step down the prefill path,
        # ~2x a decode step at batch 1 (draft="ngram": 0.79x plain decoding).
        as_rows = [bool(it.draft_token_ids or (it.budget is None and (
            it.decode_rows or (it.num_lookahead and it.num_new_tokens == 1)))) for it in rest]
        verify = [it for it, r in zip(rest, as_rows) if r]
        chunks = [it for it, r in zip(rest, as_rows) if not r]
        dec = AttentionRows()  # one query token each
        pre = AttentionRows()  # chunks of one or more query tokens
        planner = SlotPlanner(self.budget, self.seq_infos, block)
        ids: list[int] = []
        positions: list[int] = []
        # Physical slots per item in token order: a list (keeps every token), or a tensor [n] /
        # [L, n] from the planner (budgets). Plain steps stay in Python ints until one tensor.
        slots: list[list[int] | torch.Tensor] = []
        last_index: dict[int, int] = {}
        tree_rows: list[tuple[int, list[int]]] = []  # (first decode row, its rows' masks) per tree
        for index, item in enumerate(step.items[:n_dec] + verify + chunks):
            start = item.start
            if index < n_dec and item.budget is None:  # a plain decode row (most rows)
                table = item.block_table
                dec.add(table, start + 1, 1)
                slots.append([table[start // block] * block + start % block])
                last_index[item.seq_id] = len(ids)
                ids.append(item.token_ids[0])
                positions.append(start)
                continue
            n = item.num_query_tokens
            verifies = n_dec <= index < n_dec + len(verify)
            rows = dec if index < n_dec or verifies else pre
            if item.budget is None:
                if verifies:  # n decode rows, each attending up to its own position
                    if item.draft_parents:  # a tree: each node sees the prefix and its ancestors
                        tree_rows.append((len(dec), item_masks(item.num_new_tokens, item.draft_parents)))
                    for i in range(n):
                        dec.add(item.block_table, start + i + 1, 1)
                else:
                    rows.add(item.block_table, start + n, n)
                slots.append(_slots(item.block_table, start, n, block))
            else:
                try:
                    slots.append(planner.place(item, rows, rows is dec, verifies, len(ids)))
                except Exception as e:  # noqa: BLE001 — its own budget (policy, k, Keyformer schedule)
                    if failed is None:
                        raise
                    failed[item.seq_id] = describe_failure("KV budget", e)
                    continue  # this sequence alone leaves the step
            last_index[item.seq_id] = len(ids) + n - 1
            ids.extend(item.token_ids)
            ids.extend(item.draft_token_ids)
            if item.draft_parents and item.budget is None:  # a node's position is its depth's
                root = start + item.num_new_tokens - 1
                positions.extend(range(start, root + 1))
                positions.extend(root + d for d in node_depths(item.draft_parents))
            else:
                positions.extend(range(start, start + n))
        if not ids:  # every sequence failed
            return None
        if any(isinstance(s, torch.Tensor) for s in slots):  # some item is budgeted
            slot_mapping = planner.slot_mapping(
                [torch.tensor(s, dtype=torch.int64) if isinstance(s, list) else s for s in slots],
                self.num_layers, self.num_kv_heads,
            )
        else:
            slot_mapping = torch.tensor([x for s in slots for x in s], dtype=torch.int64)  # type: ignore[union-attr]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            num_decode_seqs=len(dec),
            decode_block_tables=pad_tables(dec.tables, dev),
            decode_context_lens=dec.context_lens_tensor(self.num_layers, dev),
            prefill_block_tables=pad_tables(pre.tables, dev),
            prefill_query_start_loc=torch.tensor(
                [0] + list(itertools.accumulate(pre.query_lens)), dtype=torch.int32, device=dev
            ),
            prefill_context_lens=pre.context_lens_tensor(self.num_layers, dev),
            sliding_window=self.sliding_window,
            **planner.score_args(dec, pre, dev),  # type: ignore[arg-type]
        )
        if tree_rows:
            meta.decode_tree_masks = _tree_masks(len(dec), tree_rows, dev)
        if not pre.tables:
            meta.prefill_block_tables = meta.prefill_block_tables[:0]
        if not dec.tables:
            meta.decode_block_tables = meta.decode_block_tables[:0]
        return ModelInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            last_token_index=last_index,
            score_rows=planner.score_rows,
        )

    # ---------------------------------------------------------------- execute
    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    @torch.inference_mode()
    def forward_logits(self, inputs: ModelInputs, rows: list[int]) -> tuple[torch.Tensor | None, list | None]:
        """Run the model; float32 logits of the given token rows, [len(rows), vocab] (None on a
        shard that is not the driver: the vocab-parallel LM head gathers onto rank 0, or when
        no row is asked for), and the attention scores the KV budgets asked for."""
        graphs = self.graphs
        if rows and graphs is not None and graphs.takes(inputs.input_ids, inputs.meta):
            logits = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)  # [n, vocab]
            if logits is not None:
                return logits.index_select(0, torch.tensor(rows, dtype=torch.int64, device=logits.device)), None
        logits, scores, _ = self.forward_rows(inputs, rows, [])
        return logits, scores

    def forward_rows(
        self, inputs: ModelInputs, rows: list[int], hidden_rows: list[int]
    ) -> tuple[torch.Tensor | None, list | None, torch.Tensor | None]:
        """``forward_logits`` without CUDA graphs, also returning the final hidden states of
        ``hidden_rows`` ([len(hidden_rows), hidden_size], None if none): the rows of prompt
        log-probabilities, too many for their logits at once (``engine/prompt_logprobs.py``)."""
        asked = rows + hidden_rows
        index = torch.tensor(asked, dtype=torch.int64, device=inputs.input_ids.device) if asked else None
        # only the asked rows leave the last layer (its K/V are still written for every token)
        hidden, scores = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, index)
        extra = hidden[len(rows) :] if hidden_rows else None
        logits = self.logits_fn(hidden[: len(rows)]) if rows else None
        return logits, scores, extra

    @torch.inference_mode()
    def execute(
        self,
        step: StepInput,
        draft_probs: torch.Tensor | None = None,  # [num_drafted, max_draft, vocab] p; None if all greedy
    ) -> StepOutput:
        """One forward for the whole batch: sample, verify drafts, return logits as asked."""
        start = time.perf_counter()
        out = self._execute(step, draft_probs)
        out.execute_s = time.perf_counter() - start
        return out

    def _execute(self, step: StepInput, draft_probs: torch.Tensor | None) -> StepOutput:
        if draft_probs is not None:
            draft_probs = draft_probs.to(self.device)  # a no-op where the draft shares the device
        self.apply_ops(step.ops)
        failed: dict[int, str] = {}  # seq_id -> why (its own content); empty in a normal step
        for seq_id, info in step.seq_infos.items():
            self.seq_infos[seq_id] = info
            if seq_id not in self.generators:  # a generator's stream survives a rescheduling
                try:
                    self.generators[seq_id] = make_generator(info.params.seed, info.sample_index, self.device)
                except Exception as e:  # noqa: BLE001 — its seed; fails it alone
                    failed[seq_id] = describe_failure("seed", e)
        self.copy_blocks(step.block_copies)
        out = StepOutput(failed=failed)
        if step.is_empty:
            return out
        if failed:  # a sequence that cannot even start leaves the batch before it is packed
            step = _without(step, failed)
        inputs = self.prepare(step, failed)
        items = step.items if not failed else [it for it in step.items if not _touches(it, failed)]
        if inputs is None:
            return out
        last = inputs.last_token_index
        verify = [it for it in items if it.draft_token_ids]
        forced = [it for it in items if it.forced_token_id is not None]
        sampled = [it for it in items if it.sample_seq_ids and not it.draft_token_ids and it.forced_token_id is None]
        targets = [t for it in sampled for t in it.sample_seq_ids]
        rows = [last[it.seq_id] for it in sampled for _ in it.sample_seq_ids]
        raw: list[tuple[StepItem, int, int]] = []  # (item, first row in `rows`, count)
        for item, count in itertools.chain(
            ((it, it.num_query_tokens) for it in verify),
            ((it, 1) for it in forced),
            ((it, it.return_logits) for it in items if it.return_logits),
        ):
            raw.append((item, len(rows), count))
            end = last[item.seq_id]
            rows.extend(range(end - count + 1, end + 1))
        asking = prompt_rows(items, last)  # prompt log-probabilities (rare: a scoring request)
        if asking:
            extra = [first + i for item, first in asking for i in range(item.prompt_logprob_rows)]
            all_logits, scores, hidden = self.forward_rows(inputs, rows, extra)  # Keyformer's noise: meta.noise_keys
            out.prompt_logprobs = prompt_logprobs(
                self.logits_fn, hidden, [it for it, _ in asking],  # type: ignore[arg-type]
                [self.seq_infos[it.seq_id].params.prompt_logprobs or 0 for it, _ in asking],
            )
        else:
            all_logits, scores = self.forward_logits(inputs, rows)  # Keyformer's noise: meta.noise_keys
        scores = sum_over_replicas(scores, self.model.tp, self.model.config.num_key_value_heads)
        scores = pool_over_layer(scores, inputs.score_rows, self.model.tp, self.model.config.num_key_value_heads)
        self.budget.accumulate_step(inputs.score_rows, scores, failed)
        # multi-step: the round's extra decode steps (engine/multi_step.py), after its first samples
        more = [it for it in sampled if it.num_lookahead] if step.multi_step else []
        if not self.is_driver:
            decode_on(self, more, None)
            return out
        if inputs.score_rows:  # budgeted sequences' (held, evicted) after this step
            for item in items:
                stats = self.budget.stats(item.seq_id)
                if stats is not None:
                    out.kv_stats[item.seq_id] = stats
        if all_logits is None:
            return out
        raw_logits = {item.seq_id: all_logits[first : first + n] for item, first, n in raw[len(verify):]}
        for item in items:
            if item.return_logits:
                out.logits[item.seq_id] = raw_logits[item.seq_id]
        for item in forced:
            token = item.forced_token_id
            try:
                lp = torch.log_softmax(raw_logits[item.seq_id][-1].float(), dim=-1)[token]
            except Exception as e:  # noqa: BLE001 — its forced token; fails it alone
                failed[item.seq_id] = describe_failure("forced token", e)
                continue
            out.tokens[item.seq_id] = [token]  # type: ignore[list-item]
            out.logprobs[item.seq_id] = [float(lp)]
        self._mark_generators(sampled, verify)
        if targets:  # before verification: both may draw from the global RNG, in this order
            self.sample(targets, all_logits[: len(targets)], out)
        decode_on(self, more, out)
        if verify:
            first_rows = {item.seq_id: first for item, first, _ in raw[: len(verify)]}
            self._verify(verify, all_logits, first_rows, draft_probs, out)
            verify = [it for it in verify if it.seq_id not in failed] if failed else verify
            for item in verify:
                if item.budget is not None:
                    out.kv_stats[item.seq_id] = self.budget.settled_stats(item, out.num_accepted[item.seq_id])
        return out

    def _mark_generators(self, sampled: list[StepItem], verify: list[StepItem]) -> None:
        """Before any draw: each seeded sequence's generator at its tokens so far (rewound if
        this step ran before, see ``core.generator_marks``)."""
        marks, gens = self.generator_marks, self.generators
        for item in itertools.chain(sampled, verify):
            for seq_id in item.sample_seq_ids if not item.draft_token_ids else [item.seq_id]:
                marks.before_draws(seq_id, gens.get(seq_id), item.num_output_tokens)

    def sample(self, targets: list[int], logits: torch.Tensor, out: StepOutput) -> None:
        """One token per target row (``logits`` [len(targets), vocab]). If the batch raises,
        each row is sampled alone (the error path) and the rows that still raise fail their
        sequence alone. Each row alone starts from its generator's mark (the state before
        this step's draws), so whether the batch failed before or after drawing, a seeded row
        draws what it would have drawn in the batch."""
        try:
            self._sample_rows(targets, logits, out)
        except Exception as e:  # noqa: BLE001
            self._per_row("sampling", e, targets, lambda i: self._sample_rows(targets[i : i + 1], logits[i : i + 1], out), out)

    def _sample_rows(self, targets: list[int], logits: torch.Tensor, out: StepOutput) -> None:
        params = [self.seq_infos[t].params for t in targets]
        st = SamplingTensors.from_params(params, device=logits.device)
        want_logprobs = any(p.logprobs for p in params)
        gens = [self.generators.get(t) for t in targets]
        tokens, logprobs = sample(logits, st, gens, want_logprobs)
        token_list = tokens.tolist()
        lp_list = logprobs.tolist() if logprobs is not None else None
        for i, target in enumerate(targets):
            out.tokens[target] = [token_list[i]]
            if lp_list is not None and params[i].logprobs:
                out.logprobs[target] = [lp_list[i]]
        counts = [p.top_logprobs for p in params]
        if any(counts):
            for target, top in zip(targets, top_logprobs(logits, counts)):
                if top:
                    out.top_logprobs[target] = [top]

    def _verify(
        self,
        items: list[StepItem],
        logits: torch.Tensor,  # [num_rows, vocab] this step's logits
        first_rows: dict[int, int],  # seq_id -> its first row in ``logits`` (1 + num_draft rows)
        draft_probs: torch.Tensor | None,  # [num_drafted, max_draft, vocab]; None if all greedy
        out: StepOutput,
    ) -> None:
        """Rejection sampling of every verifying sequence at once (chains), a walk down every
        tree at once (trees: ``core/spec_tree.py``); per sequence on the error path, like
        ``_sample``."""
        trees = [it for it in items if it.draft_parents]
        chains = [it for it in items if not it.draft_parents] if trees else items
        for group, verify_rows in ((chains, self._verify_rows), (trees, self._verify_tree_rows)):
            if not group:
                continue
            try:
                verify_rows(group, logits, first_rows, draft_probs, out)
            except Exception as e:  # noqa: BLE001
                self._per_row("speculative verification", e, [it.seq_id for it in group],
                              lambda i: verify_rows(group[i : i + 1], logits, first_rows, draft_probs, out), out)

    def _verify_tree_rows(
        self,
        items: list[StepItem],
        logits: torch.Tensor,  # [num_rows, vocab]
        first_rows: dict[int, int],  # seq_id -> first row in ``logits``
        draft_probs: torch.Tensor | None,  # unused: a tree's candidates are the draft's top tokens
        out: StepOutput,
    ) -> None:
        """Verify every tree at once on the logits' device (``spec_tree.verify_tree``), then
        move each accepted path's KV to the slots right after its root, where the next step
        expects its tokens."""
        if self.model.tp.size > 1:  # only the driver verifies: the other ranks could not move the KV
            raise RuntimeError("tree speculation needs a tensor-parallel size of 1")
        dev = logits.device
        counts = [len(it.draft_token_ids) for it in items]
        width = max(counts) + 1
        roots = torch.tensor([first_rows[it.seq_id] + it.num_new_tokens - 1 for it in items], dtype=torch.int64)
        num_nodes = torch.tensor(counts, dtype=torch.int64)
        # row j of a tree: its root's row + j (padding repeats the last node: never reached)
        index = roots[:, None] + torch.minimum(torch.arange(width)[None, :], num_nodes[:, None])
        tree_logits = logits.index_select(0, index.view(-1).to(dev)).view(len(items), width, -1)
        pad = width - 1
        node_tokens = torch.tensor([it.draft_token_ids + [0] * (pad - n) for it, n in zip(items, counts)],
                                   dtype=torch.int64)
        parents = torch.tensor([[-1] + it.draft_parents + [-1] * (pad - n) for it, n in zip(items, counts)],
                               dtype=torch.int64)
        params = [self.seq_infos[it.seq_id].params for it in items]
        st = SamplingTensors.from_params(params, device=dev)
        want_logprobs = any(p.logprobs for p in params)
        result = verify_tree(tree_logits, node_tokens.to(dev), parents.to(dev), num_nodes.to(dev), st,
                             [self.generators.get(it.seq_id) for it in items], want_logprobs)
        tokens = result.output_token_ids.tolist()
        accepted = result.num_accepted.tolist()
        paths = result.accepted_nodes.tolist()
        logprobs = result.logprobs.tolist() if result.logprobs is not None else None
        _emit_verified(items, params, tokens, accepted, logprobs, out)
        moves: list[tuple[int, int]] = []  # physical (source, destination) slots
        for row, item in enumerate(items):
            root = item.start + item.num_new_tokens - 1
            moves += [(self._slot(item, root + src), self._slot(item, root + dst))
                      for src, dst in kv_moves(paths[row][: accepted[row]])]
        if any(p.top_logprobs for p in params):  # the rows that emitted: the root, then the path
            rows = [r * width + j for r, a in enumerate(accepted) for j in [0] + paths[r][:a]]
            wanted = [p.top_logprobs for p, a in zip(params, accepted) for _ in range(a + 1)]
            tops = top_logprobs(tree_logits.reshape(len(items) * width, -1)[torch.tensor(rows, device=dev)], wanted)
            at = 0
            for row, item in enumerate(items):
                if params[row].top_logprobs:
                    out.top_logprobs[item.seq_id] = tops[at : at + accepted[row] + 1]
                at += accepted[row] + 1
        self._move_slots(moves)

    def _slot(self, item: StepItem, position: int) -> int:
        """Physical slot of a position of an unbudgeted item (position p in slot p)."""
        block = self.block_size
        return item.block_table[position // block] * block + position % block

    def _move_slots(self, moves: list[tuple[int, int]]) -> None:
        """Copy the K/V of each source slot to its destination slot in every layer (all
        sources read before any destination is written)."""
        if not moves:
            return
        src = torch.tensor([m[0] for m in moves], dtype=torch.int64, device=self.device)
        dst = torch.tensor([m[1] for m in moves], dtype=torch.int64, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            for cache in (k_cache, v_cache):
                flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, kv_heads, head_dim]
                flat.index_copy_(0, dst, flat.index_select(0, src))

    def _verify_rows(
        self,
        items: list[StepItem],
        logits: torch.Tensor,  # [num_rows, vocab]
        first_rows: dict[int, int],  # seq_id -> first row in ``logits``
        draft_probs: torch.Tensor | None,  # [num_drafted, max_draft, vocab]
        out: StepOutput,
    ) -> None:
        """One batched ``verify_drafts`` on the logits' device; only the emitted tokens (and
        their logprobs when asked) come back to the host, in one copy each."""
        dev = logits.device
        counts = [len(it.draft_token_ids) for it in items]
        k_max = max(counts)
        num_draft = torch.tensor(counts, dtype=torch.int64)
        firsts = [first_rows[it.seq_id] for it in items]
        start, width = firsts[0], k_max + 1
        if all(n == k_max for n in counts) and firsts == list(range(start, start + width * len(items), width)):
            # The usual step: every sequence drafted K, rows back to back -- a view, no copy.
            target_logits = logits[start : start + width * len(items)].view(len(items), width, -1)
        else:
            # Row j of a sequence's padded block: its row min(j, num_draft) (padding is never
            # where a sequence stops, so any row of its own will do).
            first = torch.tensor(firsts, dtype=torch.int64)
            index = first[:, None] + torch.minimum(torch.arange(width)[None, :], num_draft[:, None])
            target_logits = logits.index_select(0, index.view(-1).to(dev)).view(len(items), width, -1)
        draft_ids = torch.tensor([it.draft_token_ids + [0] * (k_max - n) for it, n in zip(items, counts)],
                                 dtype=torch.int64)
        params = [self.seq_infos[it.seq_id].params for it in items]
        st = SamplingTensors.from_params(params, device=dev)
        probs = None
        if draft_probs is not None and not st.all_greedy:
            rows = torch.tensor([it.draft_row for it in items], dtype=torch.int64, device=draft_probs.device)
            probs = draft_probs.index_select(0, rows)[:, :k_max]
        want_logprobs = any(p.logprobs for p in params)
        result = verify_drafts(target_logits, draft_ids, num_draft, st,
                               [self.generators.get(it.seq_id) for it in items], probs, want_logprobs)
        tokens = result.output_token_ids.tolist()
        accepted = result.num_accepted.tolist()
        logprobs = result.logprobs.tolist() if result.logprobs is not None else None
        _emit_verified(items, params, tokens, accepted, logprobs, out)
        if any(p.top_logprobs for p in params):  # each emitted token's row of the target
            wanted = [p.top_logprobs if j <= a else 0 for p, a in zip(params, accepted) for j in range(width)]
            tops = top_logprobs(target_logits.reshape(len(items) * width, -1), wanted)
            for row, item in enumerate(items):
                if params[row].top_logprobs:
                    out.top_logprobs[item.seq_id] = tops[row * width : row * width + accepted[row] + 1]

    def _per_row(self, what: str, error: Exception, seq_ids: list[int], run_row: Callable[[int], None],
                 out: StepOutput) -> None:
        """The error path of a batched stage: run each row alone, its seeded generator first
        rewound to where the batch found it (the batch may have raised after its draws); the
        rows that raise fail their sequence. If none does, the batch's error was not any one
        row's: re-raise it."""
        culprits = 0
        for i, seq_id in enumerate(seq_ids):
            self.generator_marks.rewind(seq_id, self.generators.get(seq_id))
            try:
                run_row(i)
            except Exception as e:  # noqa: BLE001
                out.failed[seq_id] = describe_failure(what, e)
                culprits += 1
        if not culprits:
            raise error


def _emit_verified(
    items: list[StepItem],
    params: list[SamplingParams],
    tokens: list[list[int]],  # per item, its emitted tokens then padding
    accepted: list[int],  # per item, drafts accepted (it emitted one more token)
    logprobs: list[list[float]] | None,  # per item, the emitted tokens' logprobs, if any asked
    out: StepOutput,
) -> None:
    """A verification's answer per item, chains and trees alike: the emitted tokens, their
    logprobs where asked, the accepted count."""
    for row, item in enumerate(items):
        a = accepted[row]
        out.tokens[item.seq_id] = tokens[row][: a + 1]
        if logprobs is not None and params[row].logprobs:
            out.logprobs[item.seq_id] = logprobs[row][: a + 1]
        out.num_accepted[item.seq_id] = a


def _touches(item: StepItem, failed: dict[int, str]) -> bool:
    """The item runs a failed sequence (or samples into one: a sibling fails the request)."""
    return item.seq_id in failed or any(t in failed for t in item.sample_seq_ids)


def _without(step: StepInput, failed: dict[int, str]) -> StepInput:
    """The step without the items that touch failed sequences (decode items stay first)."""
    decode = [it for it in step.items[: step.num_decode] if not _touches(it, failed)]
    rest = [it for it in step.items[step.num_decode :] if not _touches(it, failed)]
    return dataclasses.replace(step, items=decode + rest, num_decode=len(decode))
