"""The one message per step between the scheduler side and the model side, and its answer.

``StepInput`` carries everything a model shard needs and nothing it can look up itself: per
scheduled sequence only this step's new tokens, its start position, block table and draft
tokens. Sampling parameters travel once per sequence (``seq_infos``, the first time a sequence
reaches the executor); per-sequence generators and KV-budget states live on the executor, so
they persist across steps. The in-process ``ModelRunner`` and every Ray shard consume exactly
this message, so the distributed path adds no logic of its own. All fields are plain Python
(picklable, small); tensors only appear in ``StepOutput.logits``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields

import torch

from keyserve.core.block_manager import BlockCopy
from keyserve.core.kv_policy import KVBudget
from keyserve.core.sampling_params import SamplingParams
from keyserve.core.sequence import FinishReason


@dataclass
class SeqInfo:
    """What the executor keeps per sequence: how to sample it (and seed its generator)."""

    params: SamplingParams
    sample_index: int = 0


@dataclass
class StepItem:
    """One scheduled sequence. Query rows are its new tokens, then its draft tokens."""

    seq_id: int
    token_ids: list[int]  # this step's new (real) tokens, positions start .. start + n - 1
    start: int
    block_table: list[int]
    num_lookahead: int = 0  # slots reserved for draft tokens (the engine asks the drafter)
    draft_token_ids: list[int] = field(default_factory=list)
    draft_row: int = -1  # row of this item in the step's draft probabilities
    sample_seq_ids: list[int] = field(default_factory=list)  # sample the last row into each
    forced_token_id: int | None = None  # teacher forcing: report its log-prob, sample nothing
    return_logits: int = 0  # return raw logits of this many last rows (the draft's own use)
    budget: KVBudget | None = None  # set for a sequence under a KV budget
    # Under a budget: write this step's tokens into fresh spare slots beyond k, evicting
    # nothing, because they are speculative; a later ``SettleOp`` drops or keeps them.
    spare: bool = False
    num_output_tokens: int = 0  # tokens generated so far (Keyformer's temperature schedule)
    # Pack each query token as a decode row (no budget only): a short continuation, e.g. the
    # draft's catch-up of the last draft and the bonus token, stays on the decode path.
    decode_rows: bool = False
    # Prompt log-probabilities (SamplingParams.prompt_logprobs): this many leading rows predict
    # a prompt token (core/prompt_logprobs.py); the last such row, at the chunk's end, predicts
    # next_prompt_token, the prompt token after the chunk.
    prompt_logprob_rows: int = 0
    next_prompt_token: int = -1
    # Tree speculation (core/spec_tree.py): the parent of each draft token, as an offset from
    # the item's last new token (0; draft j sits at offset j + 1, in preorder). Empty: the
    # drafts are a chain, each the child of the one before.
    draft_parents: list[int] = field(default_factory=list)
    # The drafts were copied by prompt lookup (core/prompt_lookup.py), not drawn from the draft
    # model: adaptive K learns the model's acceptance from the others only.
    draft_copied: bool = False
    # A budgeted prompt chunk crossing the prefix store's score boundary: its first
    # ``score_split`` query tokens attend as one row and the rest as another, so the scores of
    # the queries before the boundary come back apart (``KVBudgetTracker.boundary_scores``).
    # 0: one row.
    score_split: int = 0

    def __reduce__(self) -> tuple:
        """Pickled as the constructor's arguments: half the bytes and half the unpickling time
        of the default (an instance dict per item), and every step sends one per sequence to
        the shards (16 items: 12 us against 24 us to unpickle, 935 against 1594 bytes)."""
        return StepItem, _step_item_fields(self)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_query_tokens(self) -> int:
        return len(self.token_ids) + len(self.draft_token_ids)

    @property
    def verifies(self) -> bool:
        return bool(self.draft_token_ids)


_step_item_fields = operator.attrgetter(*(f.name for f in fields(StepItem)))


@dataclass
class ForkOp:
    """A sibling now shares its parent's blocks: copy the parent's budget state."""

    parent_id: int
    child_id: int


@dataclass
class CompactOp:
    """Prompt-phase eviction of a budgeted sequence: copy its shared blocks (``copies``), keep
    k tokens per (layer, head) in the first blocks of ``block_table`` (the table before the
    engine freed the tail)."""

    seq_id: int
    block_table: list[int]
    budget: int
    copies: list[BlockCopy] = field(default_factory=list)


@dataclass
class SettleOp:
    """Speculation on a budgeted sequence resolved: its first ``num_tokens`` positions are
    valid. Drop the spare slots of later (rejected) positions, evict down to the budget by the
    policy, compact into the first blocks of ``block_table`` (the caller frees the rest)."""

    seq_id: int
    block_table: list[int]
    num_tokens: int


@dataclass
class ReleaseOp:
    """The sequence finished: drop its executor state (budget, generator, sampling info)."""

    seq_id: int


@dataclass
class RetainOp:
    """Keep executor state only for these sequences (after the scheduler side was rebuilt)."""

    seq_ids: list[int]


RunnerOp = ForkOp | CompactOp | SettleOp | ReleaseOp | RetainOp


@dataclass
class StepInput:
    items: list[StepItem]  # decode items first (one query token each), then the rest
    num_decode: int
    block_copies: list[BlockCopy] = field(default_factory=list)  # copy-on-write, before the forward
    seq_infos: dict[int, SeqInfo] = field(default_factory=dict)  # sequences new to the executor
    ops: list[RunnerOp] = field(default_factory=list)  # applied first, in order
    step: int = 0
    # The items' lookahead is extra decode steps (core/multi_step.py): the model side runs
    # them back to back, each fed its own samples, and answers as for an accepted draft run.
    multi_step: bool = False

    @property
    def decode(self) -> list[StepItem]:
        return self.items[: self.num_decode]

    @property
    def prefill(self) -> list[StepItem]:
        return self.items[self.num_decode :]

    @property
    def is_empty(self) -> bool:
        return not self.items


@dataclass
class StepOutput:
    """The one answer to a ``StepInput``. The model side fills it (only the driver rank, rank
    0; other shards return an empty one); the engine's stop checks then make the copy the KV
    core commits: ``tokens`` cut at each stop, ``finished`` set, ``num_accepted`` kept."""

    tokens: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> emitted tokens
    logprobs: dict[int, list[float]] = field(default_factory=dict)  # seq_id -> their logprobs
    # seq_id -> per emitted token, the top alternatives (token id, logprob) its params ask for
    top_logprobs: dict[int, list[list[tuple[int, float]]]] = field(default_factory=dict)
    num_accepted: dict[int, int] = field(default_factory=dict)  # verified seq_id -> drafts kept
    # seq_id -> (first position, logprob of each prompt token from there, its top alternatives,
    # its rank in the model's distribution)
    prompt_logprobs: dict[int, tuple[int, list[float], list[list[tuple[int, float]]], list[int]]] = field(
        default_factory=dict)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> [rows, vocab] f32
    kv_stats: dict[int, tuple[int, int]] = field(default_factory=dict)  # seq_id -> (held, evicted)
    execute_s: float = 0.0  # time the runner spent on the step (what orchestration adds to)
    # seq_id -> why: sequences this step could not run or sample (their request's own content);
    # they produced nothing and their requests are failed alone. Empty in a normal step.
    failed: dict[int, str] = field(default_factory=dict)
    # seq_id -> why it finished this step (the engine's stop checks; for the core's commit)
    finished: dict[int, FinishReason] = field(default_factory=dict)


def describe_failure(what: str, error: BaseException) -> str:
    """Why a sequence failed (``StepOutput.failed``), for its request's error message."""
    text = f"{what} failed: {type(error).__name__}: {error}"
    return text if len(text) <= 300 else text[:297] + "..."


def attach_drafts(
    verify: list[StepItem],
    token_ids: torch.Tensor,  # [len(verify), max_draft] int64
    num_draft: torch.Tensor,  # [len(verify)] int64
    parents: torch.Tensor | None = None,  # [len(verify), max_draft + 1] int64 tree parents, or None: chains
    copied: torch.Tensor | None = None,  # [len(verify)] bool: drafts from prompt lookup; None: none
) -> None:
    """Write a proposal into the items it was made for (row i -> ``verify[i]``): the engine
    and, on Ray, the draft actor of a compiled step fill their copies of the step alike. A
    tree's parents (row 0 the root's, -1) become each item's ``draft_parents``; ``copied``
    marks the items whose drafts prompt lookup made (``draft_copied``)."""
    counts = num_draft.tolist()
    rows = token_ids.tolist()
    trees = parents.tolist() if parents is not None else None
    lookups = copied.tolist() if copied is not None else None
    for row, item in enumerate(verify):
        item.draft_token_ids = rows[row][: counts[row]]
        item.draft_row = row
        item.draft_parents = trees[row][1 : counts[row] + 1] if trees is not None else []
        item.draft_copied = bool(lookups[row]) if lookups is not None else False
