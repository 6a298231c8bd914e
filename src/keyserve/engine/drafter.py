"""The draft side of speculative sampling: propose K tokens per sequence for a whole batch.

The draft model has its own paged KV cache and block manager. Each target sequence has a
*mirror* sequence here holding the same tokens; before proposing, the mirror is re-synced to
the target's tokens and rolled back to the longest prefix whose KV is still valid (accepted
drafts keep theirs, rejected ones are truncated away). Proposing runs one catch-up forward (the
new tokens since last time, or the whole prompt on first use) and K − 1 decode forwards, each
batched over all sequences, keeping the draft distribution p at every position in one tensor on
the draft's device (none at all when every sequence is greedy: verification then only compares
argmaxes).

A draft under a KV budget (``DraftBudget``: a cheaper draft; the rejection step keeps the
output exact whatever the draft proposes) runs each mirror like a budgeted target sequence in
its own runner and pool: prompt-phase selection and compaction after the first forward, then k
kept slots. Evicted tokens never come back, so a budgeted mirror cannot be rolled back by
truncation. Instead every token it computes after compaction -- the catch-up tokens and its
own drafts -- goes into *spare* slots beyond k without evicting anything; at the next sync,
once the target has decided, ``SettleOp`` drops the spare slots of rejected positions and
applies the evictions the kept ones imply (``KVBudgetState.rollback`` + ``evict_down_to``),
and the blocks past the kept slots go back to the pool. So a mirror never holds KV of a
rejected token, holds at most k + K + 1 slots (plus any target tokens it missed while it could
not draft, e.g. with its pool full), and needs no re-prefill. (Accumulated scores do
include the attention of rejected draft queries: that only steers the draft's own choices.)
Should the target ever disagree below the last settled point (nothing in the engine does
that), the mirror is dropped and re-prefilled from the target's tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from keyserve.config import NGRAM_DEFAULT_MAX, SpeculativeConfig
from keyserve.core.block_manager import BlockManager
from keyserve.core.generator_marks import GeneratorMarks
from keyserve.core.kv_policy import KVBudget
from keyserve.core.sampler import SamplingTensors, inverse_cdf, make_generator, processed_probs, row_argmax, row_uniforms
from keyserve.core.sequence import Sequence
from keyserve.engine.kv_budget.resolve import resolve_budget
from keyserve.engine.draft_chain import (
    confident_greedy_tokens,
    greedy_tokens,
    max_probability,
    next_decode_inputs,
    top_tokens,
    tree_level_inputs,
)
from keyserve.core.spec_tree import node_depths, tree_masks
from keyserve.engine.model_runner import ModelInputs, ModelRunner
from keyserve.engine.lookup_drafter import LookupIndexes, copied_rows, point_masses
from keyserve.engine.proposal import Proposal
from keyserve.engine.step_input import CompactOp, SeqInfo, SettleOp, StepInput, StepItem

log = logging.getLogger(__name__)

CATCH_UP_DECODE_ROWS = 8  # a mirror's new tokens up to this many run as decode rows


@dataclass
class DraftBudget:
    """The KV budget every draft mirror runs under (engine-wide, independent of the request's
    own budget on the target): budget as a fraction of the prompt (<= 1) or tokens (> 1)."""

    policy: str = "full"
    budget: float | None = None
    recent_ratio: float = 0.3

    def for_prompt(self, num_prompt_tokens: int) -> KVBudget | None:
        return resolve_budget(self.policy, self.budget, num_prompt_tokens, self.recent_ratio)


def draft_budget(config: SpeculativeConfig) -> DraftBudget:
    return DraftBudget(config.draft_kv_policy, config.draft_kv_budget, config.draft_recent_ratio)


def draft_lookup(config: SpeculativeConfig) -> tuple[int, int] | None:
    """Prompt lookup's n-gram sizes (min, max), or None when it is off (``draft="ngram"``
    looks up n-grams up to NGRAM_DEFAULT_MAX unless told otherwise)."""
    top = config.prompt_lookup_max or (NGRAM_DEFAULT_MAX if config.lookup_only else 0)
    return (config.prompt_lookup_min, top) if top else None


class Drafter:
    def __init__(
        self,
        runner: ModelRunner,
        block_manager: BlockManager,
        vocab_size: int,
        budget: DraftBudget | None = None,
        lookup: tuple[int, int] | None = None,
        confidence: float = 0.0,
    ) -> None:
        self.runner = runner
        self.block_manager = block_manager
        self.vocab_size = vocab_size
        self.budget = budget or DraftBudget()
        self.mirrors: dict[int, Sequence] = {}
        self.generators: dict[int, torch.Generator | None] = {}
        self.generator_marks = GeneratorMarks()  # a proposal made again draws the same
        self.synced: dict[int, tuple[int, int]] = {}  # target seq_id -> (its tokens, KV kept) at the last sync
        self.mirror_budgets: dict[int, KVBudget] = {}  # target seq_id -> the budget of its mirror
        self.settled: dict[int, int] = {}  # target seq_id -> tokens valid at the last settle
        self.undraftable: set[int] = set()  # target seq_ids whose drafting raised: never drafted
        # Prompt lookup (core/prompt_lookup.py): n-gram sizes, each target sequence's index, and
        # how many chain proposals (sequence-steps) and tokens it made instead of the model.
        self.lookup_index = LookupIndexes(lookup)
        # A chain ends where the draft's own distribution puts less than this on its likeliest
        # token (``SpeculativeConfig.draft_confidence_threshold``): that token and any after it are not
        # proposed. 0: every sequence drafts its K.
        self.confidence = confidence
        # Greedy unbudgeted forwards skip the runner's execute (``draft_chain.py``); False runs
        # every forward through it (the reference the chained path is tested against).
        self.chained = True

    @property
    def lookup_proposals(self) -> int:
        return self.lookup_index.proposals

    @property
    def lookup_tokens(self) -> int:
        return self.lookup_index.tokens

    # --------------------------------------------------------------- mirrors
    def _sync(self, target: Sequence) -> Sequence:
        """The mirror of ``target``, holding exactly its tokens, KV valid for a prefix."""
        tokens = target.token_ids
        mirror = self.mirrors.get(target.seq_id)
        if mirror is None:
            mirror = Sequence(target.request_id, list(tokens), target.params, arrival=target.arrival)
            self.mirrors[target.seq_id] = mirror
            seed = None if target.params.seed is None else target.params.seed ^ 0x5EED
            self.generators[target.seq_id] = make_generator(seed, target.sample_index, self.runner.device)
            kv_budget = self.budget.for_prompt(target.num_prompt_tokens)
            if kv_budget is not None:
                self.mirror_budgets[target.seq_id] = kv_budget
                mirror.kv_budget = kv_budget  # never offered as a cached prefix
            self.synced[target.seq_id] = (len(tokens), 0)
            return mirror
        old = mirror.token_ids
        # KV is valid for the computed tokens that still agree with the target. Only the tail
        # (drafts, at most 16) can disagree, so scan just that window.
        limit = min(mirror.num_computed_tokens, len(tokens), len(old))
        common = limit
        for i in range(max(0, limit - 32), limit):
            if old[i] != tokens[i]:
                common = i
                break
        # A proposal made again for the same tokens (its step was lost) starts where the first
        # one did, so it computes, and drafts, exactly the same.
        last = self.synced.get(target.seq_id)
        if last is not None and last[0] == len(tokens):
            common = min(common, last[1])
        self.synced[target.seq_id] = (len(tokens), common)
        mirror.prompt_token_ids = list(tokens)
        mirror.output_token_ids = []
        mirror.num_computed_tokens = common
        if mirror.kv_slot_cap is not None:  # budgeted and compacted
            self._settle(target.seq_id, mirror, common)
        else:
            self.block_manager.truncate(mirror, common)
        return mirror

    def _settle(self, target_id: int, mirror: Sequence, common: int) -> None:
        """A budgeted mirror keeps its first ``common`` tokens: rejected spare slots dropped,
        evictions applied, blocks past the kept slots freed (see the module docstring)."""
        if common < self.settled[target_id]:  # tokens already evicted would be needed again
            self._restart(mirror)
            return
        self.runner.apply_ops([SettleOp(mirror.seq_id, list(mirror.block_table), common)])
        self.block_manager.truncate(mirror, self._held(mirror))
        self.settled[target_id] = common

    def _restart(self, mirror: Sequence) -> None:
        """Forget the mirror's KV; the next forward re-prefills it under its budget."""
        self.block_manager.free(mirror)
        self.runner.release(mirror.seq_id)
        mirror.num_computed_tokens = 0
        mirror.kv_slot_cap = None

    def _compact(self, target_id: int, mirror: Sequence) -> None:
        """Prompt-phase selection right after a budgeted mirror's first forward: k tokens per
        (layer, head) kept in the first blocks, the rest back to the pool."""
        k = self.mirror_budgets[target_id].budget
        assert k is not None
        self.runner.apply_ops([CompactOp(mirror.seq_id, list(mirror.block_table), k)])
        self.block_manager.truncate(mirror, self._held(mirror))
        mirror.kv_slot_cap = k
        self.settled[target_id] = mirror.num_computed_tokens

    def _held(self, mirror: Sequence) -> int:
        """Slots a budgeted mirror holds per (layer, head) (the runner is always local)."""
        return self.runner.budget.states[mirror.seq_id].num_slots

    def _reserve(self, mirror: Sequence, num_new: int) -> bool:
        """Blocks for the next ``num_new`` tokens: spare slots past the kept ones for a
        compacted budgeted mirror, else the usual one slot per token."""
        if mirror.kv_slot_cap is not None:
            return self.block_manager.grow_to(mirror, self._held(mirror) + num_new)
        return self.block_manager.allocate_slots(mirror, num_new) is not None

    def release(self, target: Sequence) -> None:
        self.undraftable.discard(target.seq_id)
        self.lookup_index.drop(target.seq_id)
        mirror = self.mirrors.pop(target.seq_id, None)
        self.generators.pop(target.seq_id, None)
        self.generator_marks.drop(target.seq_id)
        self.synced.pop(target.seq_id, None)
        self.mirror_budgets.pop(target.seq_id, None)
        self.settled.pop(target.seq_id, None)
        if mirror is not None:
            self.block_manager.free(mirror)
            self.runner.release(mirror.seq_id)

    def release_all(self) -> None:
        for mirror in self.mirrors.values():
            self.block_manager.free(mirror)
            self.runner.release(mirror.seq_id)
        self.mirrors.clear()
        self.generators.clear()
        self.generator_marks.clear()
        self.synced.clear()
        self.mirror_budgets.clear()
        self.settled.clear()
        self.undraftable.clear()
        self.lookup_index.clear()

    def _step_input(self, batch: list[tuple[Sequence, Sequence, int]], num_decode: int, step: int) -> StepInput:
        """The forward's input over ``batch`` ((mirror, target, new tokens), decodes first):
        each mirror's new tokens, and its last row's logits back. Budgeted mirrors carry their
        budget (spare slots once compacted) and, the first time, their sampling info
        (Keyformer's schedule)."""
        out = StepInput([], num_decode)
        for mirror, target, n in batch:
            start = mirror.num_computed_tokens
            item = StepItem(mirror.seq_id, mirror.token_slice(start, start + n), start,
                            list(mirror.block_table), return_logits=1)
            kv_budget = self.mirror_budgets.get(target.seq_id)
            # The catch-up after a verification (the last draft and the bonus token), or a short
            # prompt: decode rows, so the draft's step stays one native decode call.
            item.decode_rows = kv_budget is None and n <= CATCH_UP_DECODE_ROWS
            if kv_budget is not None:
                item.budget = kv_budget
                item.spare = mirror.kv_slot_cap is not None
                item.num_output_tokens = len(target.output_token_ids) + step
                if item.seq_id not in self.runner.seq_infos:
                    out.seq_infos[item.seq_id] = SeqInfo(target.params, target.sample_index)
            out.items.append(item)
        return out

    # --------------------------------------------------------------- propose
    @torch.inference_mode()
    def propose(self, targets: list[Sequence], num_draft: list[int]) -> Proposal:
        """Up to ``num_draft[i]`` draft tokens for each target sequence (fewer when the draft's
        pool is full: then that sequence is verified with fewer, possibly zero, drafts).

        If the batch raises (something in one sequence: its sampling parameters, its seed),
        every mirror in it is dropped and each sequence drafts alone (the error path); one that
        still raises gets no drafts this step. Drafts never change what the target emits, only
        how fast, so nobody's output depends on this. Such a sequence is not drafted again."""
        if self.undraftable:
            rows = [i for i, t in enumerate(targets) if t.seq_id not in self.undraftable]
            if len(rows) < len(targets):
                out = self._empty(len(targets), max(num_draft, default=0))
                if rows:
                    _put(out, rows, self._propose_guarded([targets[i] for i in rows], [num_draft[i] for i in rows]))
                return out
        return self._propose_guarded(targets, num_draft)

    def _propose_guarded(self, targets: list[Sequence], num_draft: list[int]) -> Proposal:
        try:
            return self._propose(targets, num_draft)
        except Exception:  # noqa: BLE001 — see ``propose``
            log.warning("drafting failed; drafting each sequence alone", exc_info=True)
        out = self._empty(len(targets), max(num_draft, default=0))
        for target in targets:  # the failed batch may have half-advanced any of them
            self.release(target)
        for i, target in enumerate(targets):
            try:
                alone = self._propose([target], [num_draft[i]]) if len(targets) > 1 else None
            except Exception:  # noqa: BLE001
                alone = None
            if alone is None:
                log.warning("sequence %d cannot be drafted; it is verified without drafts", target.seq_id)
                self.release(target)
                self.undraftable.add(target.seq_id)
                continue
            _put(out, [i], alone)
        return out

    @property
    def supports_trees(self) -> bool:
        """Trees of drafts need a mirror that keeps every token (no draft KV budget)."""
        return self.budget.policy == "full"

    @torch.inference_mode()
    def propose_tree(self, targets: list[Sequence], trees: list[list[int]]) -> Proposal:
        """A tree of drafts for each target sequence (``trees[i]``: its parents in preorder,
        ``core/spec_tree.py``): the draft's likeliest tokens under each node, one draft forward
        per depth for the whole batch. A sequence whose mirror has no room gets no drafts.
        If the batch raises, no sequence gets drafts this step (their mirrors are re-synced
        from scratch): drafts never change what the target emits."""
        try:
            return self._propose_tree(targets, trees)
        except Exception:  # noqa: BLE001 — see the docstring
            log.warning("tree drafting failed; this step is verified without drafts", exc_info=True)
            for target in targets:
                self.release(target)
            n_max = max((len(p) - 1 for p in trees), default=0)
            return Proposal(torch.zeros(len(targets), n_max, dtype=torch.int64), None,
                            torch.zeros(len(targets), dtype=torch.int64),
                            torch.full((len(targets), n_max + 1), -1, dtype=torch.int64))

    def _propose_tree(self, targets: list[Sequence], trees: list[list[int]]) -> Proposal:
        b = len(targets)
        n_max = max((len(p) - 1 for p in trees), default=0)
        tokens = torch.zeros(b, n_max, dtype=torch.int64)
        parents = torch.full((b, n_max + 1), -1, dtype=torch.int64)
        proposed = torch.zeros(b, dtype=torch.int64)
        runner, block = self.runner, self.runner.block_size
        mirrors = [self._sync(t) for t in targets]
        # The catch-up forward: each mirror's new tokens, the last one the tree's root; room
        # reserved for them and for the nodes' slots after the root (a node's KV sits at its
        # preorder offset), or no drafts for that sequence.
        rows = []
        for i, m in enumerate(mirrors):
            n = m.num_tokens - m.num_computed_tokens
            if len(trees[i]) > 1 and n >= 1 and self._reserve(m, n + len(trees[i]) - 1):
                rows.append((i, n))
        rows.sort(key=lambda r: r[1] != 1)  # one-token decodes first, like the target's
        if not rows:
            return Proposal(tokens, None, proposed, parents)
        batch = [i for i, _ in rows]
        step_input = self._step_input([(mirrors[i], targets[i], n) for i, n in rows],
                                      sum(1 for _, n in rows if n == 1), 0)
        inputs = runner.prepare(step_input)
        assert inputs is not None
        children = [_children(trees[i]) for i in range(b)]
        widest = max(len(children[i][0]) for i in batch)
        top = top_tokens(runner, inputs, [inputs.last_token_index[mirrors[i].seq_id] for i in batch], widest).tolist()
        for i, ranked in zip(batch, top):
            mirrors[i].num_computed_tokens = mirrors[i].num_tokens
            for rank, node in enumerate(children[i][0]):
                tokens[i, node - 1] = ranked[rank]
        depths = {i: node_depths(trees[i]) for i in batch}
        masks = {i: tree_masks(trees[i]) for i in batch}
        level = 1
        while True:  # one forward per depth: the nodes that have children
            nodes = [(i, j) for i in batch for j in range(1, len(trees[i]))
                     if depths[i][j] == level and children[i][j]]
            if not nodes:
                break
            level_tokens, positions, slots, tables, lens, row_masks = [], [], [], [], [], []
            for i, j in nodes:
                m = mirrors[i]
                root = m.num_tokens - 1  # the root's position and logical slot
                slot = root + j
                level_tokens.append(int(tokens[i, j - 1]))
                positions.append(root + level)
                slots.append(m.block_table[slot // block] * block + slot % block)
                tables.append(m.block_table)
                lens.append(slot + 1)
                row_masks.append(masks[i][j])
            widest = max(len(children[i][j]) for i, j in nodes)
            level_inputs = tree_level_inputs(level_tokens, positions, slots, tables, lens, row_masks,
                                             runner.sliding_window, runner.device)
            top = top_tokens(runner, level_inputs, list(range(len(nodes))), widest).tolist()
            for (i, j), ranked in zip(nodes, top):
                for rank, child in enumerate(children[i][j]):
                    tokens[i, child - 1] = ranked[rank]
            level += 1
        for i in batch:
            parents[i, : len(trees[i])] = torch.tensor(trees[i], dtype=torch.int64)
            proposed[i] = len(trees[i]) - 1
        return Proposal(tokens, None, proposed, parents)

    def _empty(self, num_seqs: int, k_max: int) -> Proposal:
        return Proposal(torch.zeros(num_seqs, k_max, dtype=torch.int64),
                        torch.zeros(num_seqs, k_max, self.vocab_size, dtype=torch.float32),
                        torch.zeros(num_seqs, dtype=torch.int64))

    def _propose(self, targets: list[Sequence], num_draft: list[int]) -> Proposal:
        b, k_max = len(targets), max(num_draft, default=0)
        tokens = torch.zeros(b, k_max, dtype=torch.int64)
        probs: torch.Tensor | None = None  # [b, k_max, vocab] on the draft's device, if sampled
        st_all = SamplingTensors.from_params([t.params for t in targets])
        proposed = [0] * b
        mirrors = [self._sync(t) for t in targets]
        for t in targets:
            self.generator_marks.before_draws(t.seq_id, self.generators[t.seq_id], len(t.output_token_ids))
        looked_up = self.lookup_index.fill(targets, num_draft, tokens, proposed)
        active = [i for i in range(b) if num_draft[i] > 0 and i not in looked_up]
        chain: _Chain | None = None  # the last greedy forward, while the next can follow on from it
        for step in range(k_max):
            decode, chunks = [], []  # (row, new tokens): one-token decodes first, like the target's
            for i in active:
                m = mirrors[i]
                n = m.num_tokens - m.num_computed_tokens
                if not self._reserve(m, n):
                    continue  # no room in the draft pool: stop drafting for this sequence
                (decode if n == 1 else chunks).append((i, n))
            if not decode and not chunks:
                break
            rows = decode + chunks
            batch = [i for i, _ in rows]
            if self.chained and st_all.all_greedy and not any(targets[i].seq_id in self.mirror_budgets for i in batch):
                # no distribution needed (verification compares argmaxes), no budget to plan
                drawn, confident, chain = self._greedy_forward(mirrors, targets, rows, len(decode), step, chain)
            else:
                chain = None
                step_input = self._step_input([(mirrors[i], targets[i], n) for i, n in rows], len(decode), step)
                result = self.runner.execute(step_input)
                if result.failed:  # a mirror's own budget or seed: found by drafting each alone
                    raise RuntimeError(f"the draft could not run {sorted(result.failed.values())}")
                logits = torch.cat([result.logits[mirrors[i].seq_id] for i in batch])  # [n, vocab]
                if st_all.all_greedy:
                    drawn = row_argmax(logits)
                    confident = self._confident(max_probability(logits)) if self.confidence else None
                else:
                    st = SamplingTensors.from_params([targets[i].params for i in batch], logits.device)
                    p = processed_probs(logits, st)  # [n, vocab]
                    gens = [self.generators[targets[i].seq_id] for i in batch]
                    drawn = inverse_cdf(p, row_uniforms(gens, p.device))
                    # the distribution's own peak, not the drawn token's probability: stopping
                    # must not depend on which token was drawn, or the proposals would no longer
                    # be distributed as ``probs`` says and verification would not be exact
                    confident = self._confident(p.amax(-1)) if self.confidence else None
                    if probs is None:
                        probs = torch.zeros(b, k_max, p.shape[-1], dtype=torch.float32, device=p.device)
                    probs[torch.tensor(batch, device=p.device), step] = p  # one copy for the batch
            stopped = set()
            for r, (i, token) in enumerate(zip(batch, drawn.tolist())):
                m = mirrors[i]
                m.num_computed_tokens = m.num_tokens
                if targets[i].seq_id in self.mirror_budgets and m.kv_slot_cap is None:
                    self._compact(targets[i].seq_id, m)
                if confident is not None and not confident[r]:
                    stopped.add(i)  # the chain ends before this token
                    continue
                tokens[i, step] = token
                proposed[i] += 1
                m.output_token_ids.append(token)
            active = [i for i in batch if proposed[i] < num_draft[i] and i not in stopped]
        if looked_up and not st_all.all_greedy:  # a copied token is a point mass: p = 1 there
            probs = point_masses(probs, looked_up, tokens, proposed, self.vocab_size, self.runner.device)
        return Proposal(tokens, probs, torch.tensor(proposed, dtype=torch.int64),
                        copied=copied_rows(b, looked_up))

    def _confident(self, peak: torch.Tensor) -> list[bool]:  # [n] float32 -> n
        """Whether each row's draft distribution peaks at ``confidence`` or above."""
        return (peak >= self.confidence).tolist()

    def _greedy_forward(
        self, mirrors: list[Sequence], targets: list[Sequence], rows: list[tuple[int, int]],
        num_decode: int, step: int, chain: _Chain | None,
    ) -> tuple[torch.Tensor, list[bool] | None, _Chain | None]:  # [len(rows)] int64 drawn, confident, next chain
        """A greedy forward of unbudgeted mirrors (``draft_chain.py``): over the same one-token
        rows as the last forward, its inputs one position on; else packed from a ``StepInput``.
        Either way no ``execute`` and no full-vocabulary logits."""
        runner = self.runner
        batch = [i for i, _ in rows]
        tables = [len(mirrors[i].block_table) for i in batch]
        one_token = all(n == 1 for _, n in rows)
        if chain is not None and one_token and chain.batch == batch:
            grown = [mirrors[i].block_table for i in batch] if tables != chain.tables else None
            inputs = next_decode_inputs(chain.inputs, chain.drawn, grown, runner.block_size)
        else:
            step_input = self._step_input([(mirrors[i], targets[i], n) for i, n in rows], num_decode, step)
            packed = runner.prepare(step_input)
            assert packed is not None
            inputs = packed
        last = inputs.last_token_index
        wanted = [last[mirrors[i].seq_id] for i in batch]
        confident = None
        if self.confidence:
            drawn, peak = confident_greedy_tokens(runner, inputs, wanted)
            confident = self._confident(peak)
        else:
            drawn = greedy_tokens(runner, inputs, wanted)
        return drawn, confident, (_Chain(inputs, batch, tables, drawn) if one_token else None)


@dataclass
class _Chain:
    """A greedy draft forward the next one can follow on from (``draft_chain.py``)."""

    inputs: ModelInputs  # its one-token decode rows
    batch: list[int]  # the proposal's rows, in the forward's order
    tables: list[int]  # each row's block-table length then
    drawn: torch.Tensor  # [len(batch)] int64 what it drew: the next forward's input tokens


def _children(parents: list[int]) -> list[list[int]]:
    """Each row's children in preorder (the draft's likeliest first), row 0 the root's."""
    out: list[list[int]] = [[] for _ in parents]
    for j, p in enumerate(parents[1:], start=1):
        out[p].append(j)
    return out


def _put(out: Proposal, rows: list[int], part: Proposal) -> None:
    """Copy ``part`` (one row per entry of ``rows``) into rows ``rows`` of ``out``."""
    k = part.token_ids.shape[1]
    index = torch.tensor(rows, dtype=torch.int64)
    out.token_ids[index, :k] = part.token_ids
    if part.probs is not None and out.probs is not None:
        out.probs[index, :k] = part.probs.to(out.probs.device)
    out.num_draft[index] = part.num_draft
    if part.copied is not None:
        if out.copied is None:
            out.copied = torch.zeros(out.num_draft.shape[0], dtype=torch.bool)
        out.copied[index] = part.copied
