"""The draft side of speculative sampling: propose K tokens per sequence for a whole batch.

The draft model has its own paged KV cache and block manager. Each target sequence has a
*mirror* sequence here holding the same tokens; before proposing, the mirror is re-synced to
the target's tokens and rolled back to the longest prefix whose KV is still valid (accepted
drafts keep theirs, rejected ones are truncated away). Proposing runs one catch-up forward (the
new tokens since last time, or the whole prompt on first use) and K − 1 decode forwards, each
batched over all sequences, keeping the draft distribution p at every position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keyserve.core.block_manager import BlockManager
from keyserve.core.sampler import SamplingTensors, exponential_noise, make_generator, processed_probs
from keyserve.core.scheduler import ScheduledSeq, StepPlan
from keyserve.core.sequence import Sequence
from keyserve.engine.model_runner import ModelRunner
from keyserve.engine.step_input import logits_step_input


@dataclass
class Proposal:
    token_ids: torch.Tensor  # [num_seqs, max_k] int64 (0 past num_draft)
    probs: torch.Tensor  # [num_seqs, max_k, vocab] float32 draft distributions p
    num_draft: torch.Tensor  # [num_seqs] int64: drafts actually proposed per sequence


class DraftWorker:
    def __init__(self, runner: ModelRunner, block_manager: BlockManager, vocab_size: int) -> None:
        self.runner = runner
        self.block_manager = block_manager
        self.vocab_size = vocab_size
        self.mirrors: dict[int, Sequence] = {}
        self.generators: dict[int, torch.Generator | None] = {}

    # --------------------------------------------------------------- mirrors
    def _sync(self, target: Sequence) -> Sequence:
        """The mirror of ``target``, holding exactly its tokens, KV valid for a prefix."""
        tokens = target.token_ids
        mirror = self.mirrors.get(target.seq_id)
        if mirror is None:
            mirror = Sequence(target.request_id, list(tokens), target.params, arrival=target.arrival)
            self.mirrors[target.seq_id] = mirror
            seed = None if target.params.seed is None else target.params.seed ^ 0x5EED
            self.generators[target.seq_id] = make_generator(seed, target.sample_index)
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
        mirror.prompt_token_ids = list(tokens)
        mirror.output_token_ids = []
        mirror.num_computed_tokens = common
        self.block_manager.truncate(mirror, common)
        return mirror

    def release(self, target: Sequence) -> None:
        mirror = self.mirrors.pop(target.seq_id, None)
        self.generators.pop(target.seq_id, None)
        if mirror is not None:
            self.block_manager.free(mirror)

    def release_all(self) -> None:
        for mirror in self.mirrors.values():
            self.block_manager.free(mirror)
        self.mirrors.clear()
        self.generators.clear()

    # --------------------------------------------------------------- propose
    @torch.inference_mode()
    def propose(self, targets: list[Sequence], num_draft: list[int]) -> Proposal:
        """Up to ``num_draft[i]`` draft tokens for each target sequence (fewer when the draft's
        pool is full: then that sequence is verified with fewer, possibly zero, drafts)."""
        b, k_max = len(targets), max(num_draft, default=0)
        tokens = torch.zeros(b, k_max, dtype=torch.int64)
        probs = torch.zeros(b, k_max, self.vocab_size, dtype=torch.float32)
        proposed = [0] * b
        mirrors = [self._sync(t) for t in targets]
        active = [i for i in range(b) if num_draft[i] > 0]
        for step in range(k_max):
            items = []
            for i in active:
                m = mirrors[i]
                n = m.num_tokens - m.num_computed_tokens
                if self.block_manager.allocate_slots(m, n) is None:
                    continue  # no room in the draft pool: stop drafting for this sequence
                items.append((i, ScheduledSeq(m, n)))
            if not items:
                break
            plan = StepPlan(
                decode=[it for _, it in items if it.num_new_tokens == 1],
                prefill=[it for _, it in items if it.num_new_tokens > 1],
            )
            order = {id(it): i for i, it in items}
            result = self.runner.execute(logits_step_input(plan, rows=1))
            batch = [order[id(it)] for it in plan.scheduled]
            logits = torch.cat([result.logits[mirrors[i].seq_id] for i in batch])  # [n, vocab]
            st = SamplingTensors.from_params([targets[i].params for i in batch], logits.device)
            p = processed_probs(logits, st)
            gens = [self.generators[targets[i].seq_id] for i in batch]
            drawn = (p / exponential_noise(len(batch), p.shape[-1], gens, p.device)).argmax(-1)
            for row, i in enumerate(batch):
                m = mirrors[i]
                m.num_computed_tokens = m.num_tokens
                token = int(drawn[row])
                tokens[i, step] = token
                probs[i, step] = p[row].cpu()
                proposed[i] += 1
                m.output_token_ids.append(token)
            active = [i for i in batch if proposed[i] < num_draft[i]]
        return Proposal(tokens, probs, torch.tensor(proposed, dtype=torch.int64))
