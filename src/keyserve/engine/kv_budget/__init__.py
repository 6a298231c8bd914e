"""KV budgets in the engine, in one place (the pure policies are in ``core/kv_policy.py``).

- ``resolve.py``: which budget a request runs under, resolved once when it is added
  (``request_budget``; the server's ``BudgetDefaults``); it rides on ``Sequence.kv_budget``.
- ``slots.py``: slot planning for one step (``SlotPlanner``): where each budgeted token's K/V
  goes, the attention rows it adds, which scores the kernels return.
- ``tracker.py``: the model side's per-sequence state (``KVBudgetTracker``): the victims of a
  decode step (``decode_slots``: where Keyformer and H2O evict), prompt-phase selection,
  settling of speculation, score accumulation.
- ``keyformer.py``: Keyformer's temperature schedule (``tau``) and its noise keys (``noise_keys``).
- ``compaction.py``: the KV core's block-level plan (``plan_prompt_compaction``, ``settle_op``)
  and the model side's moves (``apply_compact``, ``apply_settle``, ``compact_kv``).
"""

from keyserve.engine.kv_budget.compaction import (
    apply_compact,
    apply_settle,
    compact_kv,
    plan_prompt_compaction,
    settle_op,
)
from keyserve.engine.kv_budget.resolve import BudgetDefaults, request_budget, resolve_budget
from keyserve.engine.kv_budget.slots import AttentionRows, ScoreRows, SlotPlanner, physical_slots
from keyserve.engine.kv_budget.tracker import KVBudgetTracker

__all__ = [
    "AttentionRows",
    "BudgetDefaults",
    "KVBudgetTracker",
    "ScoreRows",
    "SlotPlanner",
    "apply_compact",
    "apply_settle",
    "compact_kv",
    "physical_slots",
    "plan_prompt_compaction",
    "request_budget",
    "resolve_budget",
    "settle_op",
]
