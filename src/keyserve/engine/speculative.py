"""Speculative sampling in the engine step (docs/algorithms.md §3): how many drafts, propose,
verify.

Per step, every decoding sequence that speculates gets ``K`` draft tokens from the drafter;
the target scores all ``K + 1`` positions in the same forward as the rest of the batch;
``core.spec_decode.verify_drafts`` (run by the model runner, where the per-sequence generators
live, once per step on the logits' device: an argmax comparison when greedy, else the pure,
vectorised ``rejection_sample``) decides what is accepted; the engine
appends the accepted tokens plus one recovered or bonus token and rolls both KV caches back to
that length.
``SpeculativeDecoder`` keeps the engine-side part: how many drafts, statistics, adaptive K.
Adaptive K (``config.adaptive_k``) picks K per sequence, 0 included, from its acceptance and
the step cost the engine measures (``observe_step`` feeds ``core.step_cost.StepCostModel``), so
speculation stops where it does not pay at the current batch size; and since that model leaves
out catch-ups and partly drafting steps, ``core.spec_guard.SpeculationGuard`` turns speculation
off at a batch size for a while whenever its drafting steps delivered fewer tokens per second
than plain ones there. With a tree
(``config.speculative_tree``) adaptive K chooses per sequence between verifying the tree and
decoding plainly: the tree's tokens per step are modelled as a chain's of its depth with the
per-level continuation the sequence measures (exact for a one-level tree: 1 + P(a child is the
target's token)), and its cost is what the engine measures for tree steps, kept apart from
chains' (``tree_costs``). With prompt lookup, adaptive K is lookup-aware: the engine looks a
sequence up before choosing (``matches``), and where a copy exists K comes from copies' own
acceptance and step cost (``copy_costs``), elsewhere from the draft model's (``draft="ngram"``:
no drafts). There is one per engine, in the engine's process: it sends the KV core how many drafts each
sequence wants (``lookaheads``, with ``KVCore.schedule``), so the core (in the engine's process
or in the KV-block manager actor) holds no speculative policy of its own.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from keyserve.config import SpeculativeConfig
from keyserve.core.adaptive_k import AdaptiveK, expected_tokens
from keyserve.core.sequence import Sequence
from keyserve.core.spec_decode import AcceptanceStats
from keyserve.core.spec_guard import SpeculationGuard
from keyserve.core.spec_tree import TreeShape, node_depths
from keyserve.core.step_cost import StepCostModel
from keyserve.engine.drafter import Drafter, draft_lookup
from keyserve.engine.lookup_drafter import LookupIndexes

log = logging.getLogger(__name__)

PRIOR_TRIALS = 16.0  # decayed verified drafts before the engine's acceptance replaces the default prior


def step_samples(seqs: Iterable[Sequence]) -> bool:
    """Whether a decode step of these sequences samples (some row at T > 0): its cost is kept
    apart from greedy steps' (``core.step_cost``)."""
    return any(seq.params.temperature > 0 for seq in seqs)


class SpeculativeDecoder:
    def __init__(self, drafter: Drafter | None, config: SpeculativeConfig, cost_ratio: float) -> None:
        self.drafter = drafter
        self.config = config
        self.cost_ratio = cost_ratio
        self.stats = AcceptanceStats()  # engine total
        # The part of it prompt lookup drafted (core/prompt_lookup.py): copies are accepted
        # more often than the model's drafts and cost no draft forward, so adaptive K
        # estimates them apart (the copy arm, see ``record``).
        self.lookup_stats = AcceptanceStats()
        self.num_misses = 0  # sequence-steps that reserved draft slots and got no drafts (``record_misses``)
        self.request_stats: dict[str, AcceptanceStats] = {}
        self._adaptive: dict[int, AdaptiveK] = {}
        self.costs = StepCostModel(cost_ratio)  # measured step costs (adaptive K)
        self._last_k: dict[int, int] = {}  # seq_id -> the draft model's drafts last step (adaptive K; copies: 0)
        # Every verification in this engine, slowly decayed: a new sequence's prior for α. A
        # fixed optimistic prior (0.7) sent every request's first steps to K = 3 with a draft
        # accepted ~0.3 of the time, which cost more than the rest of a short answer gained
        # (batch 1, T = 0.8, 64 tokens: adaptive 0.96x plain while fixed K = 1 made 1.01x).
        self._engine_alpha = AdaptiveK(k_min=0, k_max=0, decay=0.995, prior_weight=0.0)  # its own drafts only
        # The same for trees (adaptive K with speculative_tree): per sequence, the tree or
        # nothing; α is a tree's per-level continuation (a step that reached depth d of D
        # accepted d levels and, when d < D, failed one), its step cost measured apart from
        # chains' (a 3-node tree of depth 1 costs what a 3-node chain's rows do, not what K = 1's do).
        self._adaptive_tree: dict[int, AdaptiveK] = {}
        self._engine_tree_alpha = AdaptiveK(k_min=0, k_max=0, decay=0.995, prior_weight=0.0)
        self.tree_costs = StepCostModel(cost_ratio)
        # What speculation delivered, step by step, against plain decoding: the model above
        # leaves out catch-ups and partly drafting steps, so outcomes have the last word
        # (core/spec_guard.py); ``_step_accepted``: drafts accepted in the step being run.
        self.guard = SpeculationGuard()
        self._step_accepted = 0
        # This step's cost says nothing steady about K: a sequence drafts after not drafting
        # (the draft catches up on its prompt or on what it missed) or probes.
        self._unsettled = False
        # Tree speculation (config.speculative_tree): the shape, and this step's sequences that
        # verify a tree (seq_id -> its parents in preorder, core/spec_tree.py).
        self.tree = TreeShape.parse(config.speculative_tree) if config.speculative_tree else None
        self.trees: dict[int, list[int]] = {}
        self.tree_capable = bool(getattr(drafter, "supports_trees", False))
        # Lookup-aware K (adaptive K with prompt lookup): a copy is accepted more often than
        # the model's draft (0.52 against 0.20 in the bench) and costs no draft forward, and
        # whether one exists is known before proposing: the drafter's lookup over the same
        # tokens finds the same match. So the engine looks first (``matches``) and a sequence
        # with a match chooses K from copies' own acceptance and step cost (the copy arm),
        # one without from the draft model's (with ``draft="ngram"``: K = 0, nothing to
        # propose, no slots reserved). One K per sequence still reaches the KV core and the
        # drafter, so neither changes.
        self.matches = LookupIndexes(draft_lookup(config))
        self._adaptive_copy: dict[int, AdaptiveK] = {}
        self._engine_copy_alpha = AdaptiveK(k_min=0, k_max=0, decay=0.995, prior_weight=0.0)
        # Steps whose drafts were all copies (no draft forward) cost less than the model's: their
        # own model, sharing plain steps as baseline; with ngram every draft is a copy.
        self.copy_costs = self.costs if config.lookup_only else StepCostModel(0.0)
        # A partly drafting step, weighed as a whole (``_step_pays``): this step's chains,
        # seq_id -> (α, whether copies), and the steps it turned plain (statistics, benches).
        self._plans: dict[int, tuple[float, bool]] = {}
        self._probing = False
        self.step_check = True
        self.num_unpaid_steps = 0

    def enabled_for(self, seq: Sequence) -> bool:
        want = seq.params.speculative
        return self.config.speculative_by_default if want is None else want

    def lookahead(
        self, seq: Sequence, max_model_len: int, batch: int = 1, sampled: bool = False,
        priors: tuple[float, float] | None = None,
    ) -> int:
        """Draft tokens for this sequence's next decode step (0 = decode plainly); ``batch``:
        how many sequences decode with it, ``sampled``: whether any of them samples (adaptive K
        weighs the step cost of that kind of step at that size); ``priors``: the step's
        ``prior_alpha()`` for the model's drafts and for copies, read once for all its
        sequences (default: read now)."""
        if not self.enabled_for(seq):
            return 0
        tree = self._tree_for(seq, max_model_len)
        if tree is not None:
            if self.config.adaptive_k and not self._tree_pays(seq, batch, sampled):
                return 0
            self.trees[seq.seq_id] = tree
            return len(tree) - 1
        k = seq.params.num_speculative_tokens or self.config.num_speculative_tokens
        if self.config.adaptive_k:
            k = self._adaptive_k(seq, k, batch, sampled, priors)
        # A step emits up to K + 1 tokens: never draft past max_tokens or the context.
        room = min(
            seq.params.max_tokens - len(seq.output_token_ids), max_model_len - seq.num_tokens
        )
        return max(0, min(k, room - 1))

    def _adaptive_k(self, seq: Sequence, k_max: int, batch: int, sampled: bool,
                    priors: tuple[float, float] | None) -> int:
        """Adaptive K for a chain: the copy arm where prompt lookup has a match now, else the
        draft model's (``matches`` in ``__init__``); K never above the copies on offer."""
        copies = self.matches.peek(seq, k_max)
        if not copies and self.config.lookup_only:
            self._last_k[seq.seq_id] = 0
            return 0
        copy = copies > 0
        arms = self._arms(False, copy)
        adaptive = arms.get(seq.seq_id)
        if adaptive is None:
            adaptive = arms[seq.seq_id] = AdaptiveK(k_min=0, k_max=k_max, cost_ratio=self.cost_ratio)
        # The prior is the engine's acceptance *now*, not when the sequence started: the
        # first sequences of a cold engine started from the default 0.7 and, the prior
        # keeping its weight, kept drafting at batch 8 (0.70x plain) after the engine had
        # seen the draft accepted ~0.3 of the time.
        adaptive.prior_alpha = self.prior_alpha(copy=copy) if priors is None else priors[copy]
        costs = self.copy_costs if copy else self.costs
        k = adaptive.choose(lambda kk: costs.relative_cost(kk, batch, sampled))
        self._plans[seq.seq_id] = (adaptive.alpha, copy)
        self._probing |= bool(k) and adaptive.last_was_probe
        if copy:
            # No forward: a steady cost whatever came before. The draft model (if any) skips
            # this step, so its next drafting step is a catch-up (``_last_k`` 0).
            self._last_k[seq.seq_id] = 0
            return min(k, copies)
        # The draft model catches up on what it skipped: not what a steady K costs.
        if k and (adaptive.last_was_probe or not self._last_k.get(seq.seq_id)):
            self._unsettled = True
        self._last_k[seq.seq_id] = k
        return k

    def _tree_pays(self, seq: Sequence, batch: int, sampled: bool) -> bool:
        """Adaptive K with a tree: whether this sequence verifies the tree next step (else it
        decodes plainly). The same chooser as chains', over two arms: K = the tree's depth,
        costing what tree steps measure at this batch size, or K = 0 (probes included)."""
        assert self.tree is not None
        depth = self.tree.depth
        adaptive = self._adaptive_tree.get(seq.seq_id)
        if adaptive is None:
            adaptive = self._adaptive_tree[seq.seq_id] = AdaptiveK(
                k_min=0, k_max=depth, cost_ratio=self.cost_ratio, probe_k=depth)
        adaptive.prior_alpha = self.prior_alpha(tree=True)
        tree_cost = self.tree_costs.relative_cost(depth, batch, sampled)
        k = adaptive.choose(lambda kk: tree_cost if kk == depth else math.inf)
        if k and (adaptive.last_was_probe or not self._last_k.get(seq.seq_id)):
            self._unsettled = True
        self._last_k[seq.seq_id] = k
        return k > 0

    def _tree_for(self, seq: Sequence, max_model_len: int) -> list[int] | None:
        """The tree a sequence verifies next step (its parents), or None for a chain: trees
        need a drafter that builds them, a sequence without a KV budget, room for the tree's
        depth + 1 tokens and for its nodes' slots."""
        tree = self.tree
        if tree is None or not self.tree_capable or seq.kv_budget is not None:
            return None
        room = min(seq.params.max_tokens - len(seq.output_token_ids), max_model_len - seq.num_tokens)
        if room - 1 < 1 or seq.num_tokens + tree.num_nodes > max_model_len:
            return None
        return list(tree.trim(room - 1).parents) if room - 1 < tree.depth else list(tree.parents)

    def lookaheads(self, seqs: Iterable[Sequence], max_model_len: int) -> dict[int, int]:
        """seq_id -> draft tokens wanted next step, for the sequences that want any. The KV core
        reserves them only for a sequence that decodes this step and is not waiting for its
        prompt-phase KV selection. With adaptive K, none while the step cost model wants a
        plain step at this batch size (its baseline) or the guard has turned speculation off
        there (it delivered fewer tokens per second than plain decoding)."""
        seqs = list(seqs)
        self._unsettled = False
        self._step_accepted = 0
        self.trees = {}
        self._plans = {}
        self._probing = False
        sampled = step_samples(seqs)
        if self.config.adaptive_k and seqs and (
                self.costs.wants_plain(len(seqs), sampled)
                or (self.tree is not None and self.tree_costs.wants_plain(len(seqs), sampled))
                or (self.matches.sizes is not None and self.copy_costs.wants_plain(len(seqs), sampled))
                or self.guard.blocks(len(seqs), sampled)):
            for seq in seqs:
                self._last_k[seq.seq_id] = 0
            return {}
        wanted: dict[int, int] = {}
        priors = (self.prior_alpha(), self.prior_alpha(copy=True)) if self.config.adaptive_k else None
        for seq in seqs:
            try:
                k = self.lookahead(seq, max_model_len, len(seqs), sampled, priors)
            except Exception:  # noqa: BLE001 — its speculative settings: it decodes plainly
                log.warning("no speculation for sequence %d", seq.seq_id, exc_info=True)
                k = 0
            if k:
                wanted[seq.seq_id] = k
        if (self.config.adaptive_k and self.step_check and 0 < len(wanted) < len(seqs)
                and not self.trees and not self._probing
                and not self._step_pays(wanted, len(seqs), sampled)):
            for seq_id in wanted:
                self._last_k[seq_id] = 0  # it skipped: its draft's next step catches up
            self.num_unpaid_steps += 1
            return {}
        return wanted

    def _step_pays(self, wanted: dict[int, int], batch: int, sampled: bool) -> bool:
        """Whether a step in which only some sequences draft is worth its cost as a whole: the
        drafters' expected extra tokens, each worth a plain step's time per sequence, against
        what such a step adds to a plain one (``StepCostModel.extra_seconds``: a fixed part paid
        once per drafting step, plus a part per drafted row).

        Each sequence chose its K against a step in which every sequence drafts, where the
        fixed part is shared; a lone drafter pays it alone. Measured at batch 8 on 2 cores with
        prompt lookup alone: steps with 1.2 copying sequences took 89.8 ms against 79.3 ms plain
        for 0.72 accepted copies (0.96x the plain rate), steps with 2.3 took 77.5 against 66.2 ms
        for 2.39 (1.11x). Until the fit has its samples the sequences' choices stand."""
        plans = [(self._plans[seq_id], k) for seq_id, k in wanted.items()]  # every chain's K came from _adaptive_k
        copies_only = all(copy for (_, copy), _ in plans)
        costs = self.copy_costs if copies_only else self.costs
        plain = costs.plain_seconds(batch, sampled)
        extra = costs.extra_seconds(sum(wanted.values()), batch, sampled)
        if plain is None or extra is None:
            return True
        gain = 0.0
        for (alpha, _), k in plans:
            gain += expected_tokens(min(max(alpha, 0.0), 1.0), k) - 1.0
        return gain * plain / batch > extra

    def observe_step(self, batch: int, k: int, seconds: float, sampled: bool = False,
                     drafting: int | None = None, trees: int = 0, copies: int = 0,
                     rows: int | None = None) -> None:
        """The engine's measured time of one decode step (no prompt chunk in it) of ``batch``
        sequences, ``drafting`` of them (default: all) drafting up to ``k`` each, ``trees`` of
        them verifying a tree, ``copies`` of them verifying prompt lookup's copies, ``rows``
        drafted tokens in all (default: ``k`` x the drafting sequences): the step
        cost models learn from it (a plain step is every model's baseline, a step with trees
        is the trees', one whose drafts were all copies is the copies'), unless a sequence's
        draft was catching up or probing in it (not what a steady K costs). The guard takes
        every step, catch-ups included: they are part of what speculating costs."""
        if not self.config.adaptive_k:
            return
        accepted, self._step_accepted = self._step_accepted, 0  # none in a plain step
        self.guard.record(batch, seconds, batch + accepted, k > 0, sampled)
        if k and self._unsettled:
            return
        if trees and self.tree is not None:
            self.tree_costs.record(batch, self.tree.depth, seconds, sampled, trees)
            return
        drafted = batch if drafting is None else drafting
        costs = self.copy_costs if k and copies >= drafted else self.costs
        costs.record(batch, k, seconds, sampled, drafting, rows)
        if not k and self.tree is not None:
            self.tree_costs.record(batch, 0, seconds, sampled)
        if not k and self.copy_costs is not self.costs:
            self.copy_costs.record(batch, 0, seconds, sampled)

    def record(self, request_id: str, seq_id: int, num_draft: int, num_accepted: int,
               parents: list[int] | None = None, copied: bool = False) -> None:
        """Statistics of one verification (engine total and per request: drafts are a tree's
        nodes), and adaptive K's acceptance estimate for the sequence; ``parents``: the tree's
        (core/spec_tree.py), None for a chain; ``copied``: prompt lookup drafted them.

        Copies and the model's drafts are estimated apart (the copy arm and the model's): a
        copy is accepted ~70 % of the time where the model's drafts are ~45 % (greedy chat
        answers), and copies come in runs (repeated passages), so counting them together sent
        sequences to K > 0 at batch 8, where the model's own drafts do not pay (adaptive K
        with lookup: 0.92x plain in one round)."""
        self.stats.update([num_draft], [num_accepted])
        self._step_accepted += num_accepted
        self.request_stats.setdefault(request_id, AcceptanceStats()).update([num_draft], [num_accepted])
        if copied:
            self.lookup_stats.update([num_draft], [num_accepted])
        if parents:
            self.adapt(seq_id, max(node_depths(parents)), num_accepted, tree=True)
        else:
            self.adapt(seq_id, num_draft, num_accepted, copy=copied)

    def record_misses(self, request_ids: list[str]) -> None:
        """Sequences (one entry per sequence, its request's id) that reserved draft slots and
        got no drafts this step: with fixed K and ``draft="ngram"``, prompt lookup finding no
        match; with a draft model, its pool full or its confidence below
        ``draft_confidence_threshold`` at the first draft. Each is a target forward that
        emitted one token, so it counts in tokens per forward (engine and request statistics)
        as a verification of zero drafts; adaptive K does not see it: it asks for drafts where
        the lookup has a match (the copy arm), so a step without one no longer reaches it (it
        once counted as a first draft rejected, which kept ngram from drafting at batch 8 but
        made it too cautious at batch 1: 0.99x plain decoding where fixed K = 3 made 1.15x)."""
        self.num_misses += len(request_ids)
        for request_id in request_ids:
            self.stats.update([0], [0])
            self.request_stats.setdefault(request_id, AcceptanceStats()).update([0], [0])

    def prior_alpha(self, tree: bool = False, copy: bool = False) -> float:
        """Every sequence's prior acceptance (re-read each step): this engine's recent
        acceptance (of trees' levels with ``tree``, of prompt lookup's copies with ``copy``)
        once it has seen PRIOR_TRIALS verified drafts, else AdaptiveK's default."""
        engine = self._engine_estimate(tree, copy)
        return engine.alpha if engine.tested >= PRIOR_TRIALS else AdaptiveK.prior_alpha

    def _engine_estimate(self, tree: bool, copy: bool) -> AdaptiveK:
        return self._engine_tree_alpha if tree else self._engine_copy_alpha if copy else self._engine_alpha

    def _arms(self, tree: bool, copy: bool) -> dict[int, AdaptiveK]:
        """Per-sequence estimates of trees, of copies, or of the draft model's chains."""
        return self._adaptive_tree if tree else self._adaptive_copy if copy else self._adaptive

    def adapt(self, seq_id: int, num_draft: int, num_accepted: int, tree: bool = False,
              copy: bool = False) -> None:
        """Feed adaptive K's acceptance estimates, the sequence's (``lookahead`` picks K from
        it) and the engine's (new sequences start from it); with ``tree``, ``num_draft`` is the
        tree's depth and the estimates are trees' own; with ``copy``, prompt lookup's."""
        if not num_draft:
            return
        self._engine_estimate(tree, copy).observe([num_draft], [num_accepted])
        adaptive = self._arms(tree, copy).get(seq_id)
        if adaptive is not None:
            adaptive.observe([num_draft], [num_accepted])

    def forget(self, seq_id: int) -> None:
        self._adaptive.pop(seq_id, None)
        self._adaptive_copy.pop(seq_id, None)
        self.matches.drop(seq_id)
        self._adaptive_tree.pop(seq_id, None)
        self._last_k.pop(seq_id, None)

    def release(self, seq: Sequence) -> None:
        if self.drafter is not None:
            self.drafter.release(seq)
        self.forget(seq.seq_id)

    def pop_request_stats(self, request_id: str) -> AcceptanceStats | None:
        return self.request_stats.pop(request_id, None)

