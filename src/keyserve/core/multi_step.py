"""Which sequences decode several tokens in one scheduling round (multi-step scheduling).

Why: a round trip through the scheduler side (schedule, commit, stop checks; on Ray the hops
driver -> KV-block manager -> shards -> driver) costs about a millisecond on a 2-core CPU
whatever the step computes (docs/BENCHMARKS.md, "Ray engine"). With N steps per round the model
side runs N decode forwards back to back, feeding each its own samples, and the round trip is
paid once per N tokens -- vLLM's ``--num-scheduler-steps``. The KV core reserves the extra
tokens' slots exactly as it reserves draft tokens' (``num_lookahead``), and the engine commits
them as a verified run whose every token was accepted: a stop inside the run cuts it there.

Only a steady decode batch runs it: every running sequence past its prompt with its KV
computed, so a prompt the scheduler could start now waits at most one round and never shares a
step with it. A prompt queued behind ``max_num_seqs`` (no seat for it until a sequence ends)
does not stop the rounds: under a full queue, as in a batch job, they run too, and a seat freed
inside a round is taken after it. A sequence under a KV budget (its eviction reads each step's
attention), with forced tokens, or at the end of its ``max_tokens`` or context takes no extra
steps.
"""

from __future__ import annotations

from collections.abc import Iterable

from keyserve.core.sequence import Sequence


def multi_step_lookahead(
    seqs: Iterable[Sequence], num_steps: int, max_model_len: int, max_num_seqs: int,
    forced: set[int] = frozenset(),
) -> dict[int, int] | None:
    """seq_id -> extra decode steps for this round (``num_steps - 1`` at most, never past a
    sequence's ``max_tokens`` or the context), or None when the round must be a single step:
    multi-step is off, a sequence is part way through its prompt (or its recomputation after
    a preemption), a queued one could take a seat now, or no sequence would take an extra step.
    ``seqs``: every unfinished sequence of the engine; ``forced``: the ids of sequences whose
    tokens are forced (teacher forcing)."""
    if num_steps <= 1:
        return None
    seqs = list(seqs)
    decoding = [s for s in seqs if s.output_token_ids and s.num_tokens - s.num_computed_tokens == 1]
    if len(decoding) < len(seqs):
        queued = [s for s in seqs if s.num_computed_tokens == 0]
        if len(queued) < len(seqs) - len(decoding) or len(decoding) < max_num_seqs:
            return None  # prompt work that runs now, or could
    ahead: dict[int, int] = {}
    for seq in decoding:
        if seq.kv_budget is not None or seq.seq_id in forced:
            continue
        # The round emits up to 1 + k tokens: never past max_tokens or the context.
        room = min(seq.params.max_tokens - len(seq.output_token_ids), max_model_len - seq.num_tokens)
        k = min(num_steps - 1, room - 1)
        if k > 0:
            ahead[seq.seq_id] = k
    return ahead or None
