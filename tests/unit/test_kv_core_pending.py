"""KVCore's pending siblings (n > 1 samples waiting to fork at their first sample's prompt):
one that finishes before it forked leaves its request's list, and only its own, wherever the
other requests' lists are -- through the sibling -> parent index, not a scan of every list."""

from __future__ import annotations

from keyserve.core.sampling_params import SamplingParams
from keyserve.core.scheduler import SchedulerConfig
from keyserve.core.sequence import FinishReason, Sequence
from keyserve.engine.kv_core import KVCore


def _request(rid: str, n: int) -> tuple[Sequence, list[Sequence]]:
    params = SamplingParams(n=n, max_tokens=4, temperature=1.0)
    first = Sequence(rid, [1, 2, 3], params)
    siblings = [Sequence(rid, [1, 2, 3], params, sample_index=i) for i in range(1, n)]
    return first, siblings


def test_a_sibling_finished_before_its_fork_leaves_only_its_own_list() -> None:
    core = KVCore(64, 4, False, SchedulerConfig(), 128)
    a, a_siblings = _request("a", 3)
    b, b_siblings = _request("b", 3)
    core.add([a], a_siblings)
    core.add([b], b_siblings)
    core.finish(b_siblings[0].seq_id, FinishReason.ABORT)
    assert core.pending[b.seq_id] == [b_siblings[1]]
    assert core.pending[a.seq_id] == a_siblings
    assert b_siblings[0].seq_id not in core.seqs and b_siblings[0].seq_id not in core.pending_parent
    core.finish(a.seq_id, FinishReason.ABORT)  # the parent: its whole list goes
    assert a.seq_id not in core.pending
    core.finish(a_siblings[1].seq_id, FinishReason.ABORT)  # a sibling of a finished parent
    assert core.pending[b.seq_id] == [b_siblings[1]]
