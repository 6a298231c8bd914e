"""Slot planning for one step: where each token's K/V is written and what each attention row
sees, for sequences under a KV budget (carved out of ``ModelRunner.prepare``).

A budgeted sequence's *logical* slot ``s`` lives at physical slot
``block_table[s // B] * B + s % B``, like any other; what differs is which logical slot a token
takes. In the prompt phase (and for a draft's speculative tokens) every token takes a fresh
slot and nothing is evicted. A decoding sequence at its budget writes its new token into the
slot of the token it evicts, chosen per (layer, kv-head) -- so its slot mapping is
``[num_layers, num_tokens, num_kv_heads]`` and its victims are picked for the whole batch in one
call (``KVBudgetTracker.decode_slots``) once every row is placed. A target verifying K drafts
writes its K + 1 positions into spare slots past the ones it holds and contributes K + 1
decode rows over its one block table, row i attending to the held slots plus the new ones up
to its own (causal); its per-row scores wait for the verdict (``KVBudgetTracker.settle``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from keyserve.core.kv_policy import KVBudgetState
from keyserve.engine.kv_budget.keyformer import noise_keys, tau
from keyserve.engine.step_input import SeqInfo, StepItem

# A budgeted item whose scores come back: (item, in the decode rows?, first row, rows).
ScoreRows = tuple[StepItem, bool, int, int]


def physical_slots(
    logical: torch.Tensor,  # [...] int64 logical slots of one sequence
    block_table: torch.Tensor,  # [num_blocks] int64
    block_size: int,
) -> torch.Tensor:  # [...] int64
    return block_table[logical // block_size] * block_size + logical % block_size


@dataclass
class AttentionRows:
    """Attention rows of one kind (decode or prefill), one entry per attended sequence."""

    tables: list[list[int]] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    modes: list[str | None] = field(default_factory=list)
    taus: list[float] = field(default_factory=list)
    # row -> [num_layers] context lengths, for a sequence whose layers hold different counts
    layer_context_lens: dict[int, list[int]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tables)

    def context_lens_tensor(self, num_layers: int, device: torch.device) -> torch.Tensor:
        """[num_rows] int32, or [num_layers, num_rows] when some row's layers differ."""
        lens = torch.tensor(self.context_lens, dtype=torch.int32)
        if self.layer_context_lens:
            lens = lens.expand(num_layers, -1).clone()
            for row, per_layer in self.layer_context_lens.items():
                lens[:, row] = torch.tensor(per_layer, dtype=torch.int32)
        return lens.to(device)

    def truncate(self, num_rows: int) -> None:
        """Drop the rows from ``num_rows`` on (a sequence that left the batch)."""
        for rows in (self.tables, self.context_lens, self.query_lens, self.modes, self.taus):
            del rows[num_rows:]
        for row in [r for r in self.layer_context_lens if r >= num_rows]:
            del self.layer_context_lens[row]

    def add(self, table: list[int], context_len: int, query_len: int, mode: str | None = None,
            tau: float = 1.0) -> None:
        self.tables.append(table)
        self.context_lens.append(context_len)
        self.query_lens.append(query_len)
        self.modes.append(mode)
        self.taus.append(tau)


@dataclass
class _Deferred:
    """A decoding sequence at its budget: its slots wait for the batch's victim choice."""

    token: int  # its row in the step's tokens
    item: StepItem
    rows: AttentionRows
    index: int  # its row in ``rows``


class SlotPlanner:
    """The budgeted sequences of one step: their slots, attention rows and score rows."""

    def __init__(
        self,
        tracker: object,  # KVBudgetTracker (typed loosely: the tracker imports this module)
        seq_infos: dict[int, SeqInfo],
        block_size: int,
    ) -> None:
        self.tracker = tracker
        self.seq_infos = seq_infos
        self.block_size = block_size
        self.score_rows: list[ScoreRows] = []
        self.modes: set[str] = set()  # score modes asked for (H2O: softmax, Keyformer: gumbel)
        self._deferred: list[_Deferred] = []
        self._layered = False  # some sequence's layers hold different counts
        # Keyformer rows' noise keys: (in the decode rows?, row, seq_id, first query position)
        self._noise: list[tuple[bool, int, int, int]] = []

    def place(
        self,
        item: StepItem,
        rows: AttentionRows,
        is_decode: bool,  # ``rows`` are the step's decode rows
        verifies: bool,  # a target verifying drafts in spare slots
        token: int,  # the item's first row in the step's tokens
    ) -> torch.Tensor:  # [n] or [num_layers, n] physical slots of its n query tokens
        """Start or continue the item's budget state, add its attention rows and return where
        its tokens go. If it raises, nothing of the item is left in the batch (its half-made
        budget state goes when its request is aborted)."""
        marks = (len(rows), len(self.score_rows), len(self._deferred))
        try:
            slots, mode = self._place(item, rows, is_decode, verifies, token)
        except BaseException:
            rows.truncate(marks[0])
            del self.score_rows[marks[1]:], self._deferred[marks[2]:]
            raise
        if mode == "gumbel":  # one row per verified position, else one row per side of a split
            for i, row in enumerate(range(marks[0], len(rows))):
                first = i if verifies else (item.score_split if i else 0)
                self._noise.append((is_decode, row, item.seq_id, item.start + first))
        if mode is not None:
            self.modes.add(mode)
        if slots.dim() == 2:
            self._layered = True
        return slots

    def _place(self, item: StepItem, rows: AttentionRows, is_decode: bool, verifies: bool,
               token: int) -> tuple[torch.Tensor, str | None]:
        tracker = self.tracker
        start, n, table = item.start, item.num_query_tokens, item.block_table
        state = tracker.get(item)  # type: ignore[attr-defined]
        if state is None or start == 0:
            state = tracker.start(item, item.budget)  # type: ignore[attr-defined]
        mode = tracker.score_mode(item)  # type: ignore[attr-defined]
        decoding = not tracker.due_for_compaction(item)  # type: ignore[attr-defined]
        split = item.score_split if 0 < item.score_split < n and not (verifies or is_decode) else 0
        self.score_rows.append((item, is_decode, len(rows), n if verifies else (2 if split else 1)))
        if verifies:
            if not decoding:
                raise RuntimeError("speculative verification of a budgeted prompt")
            held = state.num_slots
            logical = state.append(n)
            tracker.expect_rows(item, start)  # type: ignore[attr-defined]
            for i in range(n):
                rows.add(table, held + i + 1, 1, mode, self._tau(item, state, True, offset=i))
        elif not decoding or item.spare:
            # Prompt phase, or the draft's speculative tokens: fresh slots, no eviction.
            logical = state.append(n)  # [n], or [L, n] while its layers hold different counts
            # A split chunk attends as two rows, the queries before the boundary over the slots
            # up to it: the same attention, and their scores come back apart.
            sides = ((n - split, split), (0, n - split)) if split else ((0, n),)
            for behind, count in sides:
                rows.add(table, state.num_slots - behind, count, mode, self._tau(item, state, decoding))
                if state.layer_held is not None:
                    rows.layer_context_lens[len(rows) - 1] = (state.layer_held - behind).tolist()
        else:
            if n != 1:
                raise RuntimeError("a compacted sequence can only decode one token per step")
            logical = torch.zeros(1, dtype=torch.int64)  # replaced per head in ``slot_mapping``
            self._deferred.append(_Deferred(token, item, rows, len(rows)))
            rows.add(table, -1, 1, mode, self._tau(item, state, True))  # context once victims are known
        return physical_slots(logical.cpu(), torch.tensor(table, dtype=torch.int64), self.block_size), mode

    def _tau(self, item: StepItem, state: KVBudgetState, decoding: bool, offset: int = 0) -> float:
        return tau(state.kv_budget, self.seq_infos, item, decoding, offset)

    def slot_mapping(
        self,
        slots: list[torch.Tensor],  # per item in token order: [n] or [num_layers, n] physical slots
        num_layers: int,
        num_kv_heads: int,
    ) -> torch.Tensor:  # [num_tokens], or [num_layers, num_tokens, num_kv_heads]
        """The step's slot mapping. With a decoding sequence at its budget (or layers holding
        different counts) it is per (layer, head): the victims of every such sequence are
        chosen here, in one call, and their context lengths filled in."""
        if not self._deferred and not self._layered:
            return torch.cat(slots)
        per_layer = torch.cat([s.expand(num_layers, -1) for s in slots], dim=1)  # [L, num_tokens]
        full = per_layer[:, :, None].expand(-1, -1, num_kv_heads).clone()
        if self._deferred:
            tracker = self.tracker
            victims = tracker.decode_slots([d.item for d in self._deferred])  # type: ignore[attr-defined]
            for i, d in enumerate(self._deferred):  # [n, L, H] logical
                table = torch.tensor(d.item.block_table, dtype=torch.int64)
                full[:, d.token, :] = physical_slots(victims[i].cpu(), table, self.block_size)
                d.rows.context_lens[d.index] = tracker.states[d.item.seq_id].num_slots  # type: ignore[attr-defined]
        return full

    def score_args(self, dec: AttentionRows, pre: AttentionRows, device: torch.device) -> dict[str, object]:
        """The attention metadata's score fields: which scores the kernels return (None,
        "softmax", "gumbel", or "mixed" when H2O and Keyformer share the step), Keyformer's
        temperature and noise key per row and, for "mixed", which rows are Keyformer's."""
        if not self.modes:
            return {"score_mode": None, "tau": None, "gumbel_rows": None, "noise_keys": None}
        score = next(iter(self.modes)) if len(self.modes) == 1 else "mixed"
        taus = torch.tensor(dec.taus + pre.taus, dtype=torch.float32, device=device)
        gumbel = None
        if score == "mixed":
            gumbel = torch.tensor([m == "gumbel" for m in dec.modes + pre.modes], device=device)
        keys = None
        if "gumbel" in self.modes:
            rows = [(row if in_dec else len(dec) + row, seq_id, pos) for in_dec, row, seq_id, pos in self._noise]
            keys = noise_keys(rows, len(dec) + len(pre), self.seq_infos,
                              self.tracker.noise_generator, device)  # type: ignore[attr-defined]
        return {"score_mode": score, "tau": taus, "gumbel_rows": gumbel, "noise_keys": keys}
