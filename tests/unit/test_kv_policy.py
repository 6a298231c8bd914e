"""KV budget policies against a direct, loop-based re-implementation of docs/algorithms.md §2.

The reference keeps, per (layer, kv-head), a dict position → accumulated score and applies the
rules literally (sorting Python tuples); the policy under test is the vectorised slot-based
``KVBudgetState``. Both see the same attention scores, computed per position: random integers
(exact in float32, so ties are common and tie-breaking is exercised), or real softmax / Gumbel
softmax scores from random queries and keys with fixed uniforms (H2O / Keyformer).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyserve.core.kv_policy import (
    KVBudget,
    KVBudgetState,
    KVPolicy,
    accumulate_batch,
    choose_victims_batch,
    compaction_map,
    keyformer_tau,
    order_key,
    recent_window,
    score_mode,
    stack_layer_scores,
)

POLICIES = ["window", "streaming_llm", "h2o", "keyformer"]


# ------------------------------------------------------------------------------------------------
# Reference algorithm (loops, Python numbers).
# ------------------------------------------------------------------------------------------------


def ref_rule(policy: str, k: int, ratio: float) -> tuple[int, int, bool]:
    """(sinks, recent, by_score) straight from docs/algorithms.md §2."""
    if policy == "window":
        return 0, k, False
    if policy == "streaming_llm":
        s = min(4, k - 1)
        return s, k - s, False
    return 0, min(k, int(math.floor(ratio * k + 0.5))), True


class RefHead:
    """One (layer, kv-head): held positions with their accumulated score S (float32)."""

    def __init__(self, k: int, sinks: int, recent: int, by_score: bool) -> None:
        self.k, self.sinks, self.recent, self.by_score = k, sinks, recent, by_score
        self.S: dict[int, np.float32] = {}
        self.dropped: set[int] = set()

    def key(self, pos: int) -> tuple[float, int]:
        return (float(self.S[pos]) if self.by_score else 0.0, pos)

    def add(self, pos: int) -> None:
        self.S[pos] = np.float32(0.0)

    def add_scores(self, f: dict[int, float]) -> None:
        for pos in self.S:
            self.S[pos] = np.float32(self.S[pos] + np.float32(f[pos]))

    def _candidates(self, newest: int) -> list[int]:
        return [
            p for p in self.S if p >= self.sinks and p <= newest - self.recent
        ]

    def decode(self, p: int) -> int | None:
        """Evict (if at budget), then hold p. Returns the victim's position."""
        victim = None
        if len(self.S) >= self.k:
            cands = self._candidates(p)
            victim = min(cands, key=self.key)
            del self.S[victim]
            self.dropped.add(victim)
        self.add(p)
        return victim

    def keep_top(self, k: int, newest: int, sinks: int, recent: int) -> None:
        """Prompt phase / evict_down_to: keep sinks + recent + the best of the rest."""
        m = len(self.S) - k
        if m <= 0:
            return
        cands = [p for p in self.S if p >= sinks and p <= newest - recent]
        for victim in sorted(cands, key=self.key)[:m]:
            del self.S[victim]
            self.dropped.add(victim)


# ------------------------------------------------------------------------------------------------
# Score sources, computed per position (the oracle) and per slot (what the engine passes).
# ------------------------------------------------------------------------------------------------


class ScoreSource:
    """Attention scores for one forward over held tokens, as the kernels would produce them.

    ``kind``: "int" (random integers), "softmax" (H2O) or "gumbel" (Keyformer, fixed uniforms).
    Queries and keys are random and fixed per position (keys are cached after RoPE at their
    original positions, so a key is a function of its position only).
    """

    def __init__(self, kind: str, L: int, H: int, max_pos: int, seed: int, G: int = 2, d: int = 4):
        self.kind, self.L, self.H, self.G, self.d = kind, L, H, G, d
        g = torch.Generator().manual_seed(seed)
        self.keys = torch.randn(L, H, max_pos, d, generator=g, dtype=torch.float64)
        self.queries = torch.randn(L, H, G, max_pos, d, generator=g, dtype=torch.float64)
        self.gen = g

    def forward(self, query_positions: list[int], tau: float, held: torch.Tensor) -> torch.Tensor:
        """Per-position scores [L, H, max_pos] float32 summed over this forward's queries.

        ``held`` [L, H, max_pos] bool says which positions each head holds. The score of a
        position is computed by plain Python loops (the reference formula); the result is then
        used by both implementations.
        """
        L, H, G, P = self.L, self.H, self.G, held.shape[-1]
        out = np.zeros((L, H, P), dtype=np.float64)
        if self.kind == "int":
            r = torch.randint(0, 4, (L, H, P), generator=self.gen).numpy()
            return torch.from_numpy((r * held.numpy()).astype(np.float32))
        U = torch.rand(L, H, G, len(query_positions), P, generator=self.gen, dtype=torch.float64)
        for l in range(L):
            for h in range(H):
                for g in range(G):
                    for qi, qp in enumerate(query_positions):
                        js = [j for j in range(qp + 1) if held[l, h, j]]
                        x = {}
                        for j in js:
                            dot = float(self.queries[l, h, g, qp] @ self.keys[l, h, j])
                            x[j] = dot / math.sqrt(self.d)
                            if self.kind == "gumbel":
                                u = min(max(float(U[l, h, g, qi, j]), 1e-20), 1 - 1e-7)
                                x[j] = (x[j] - math.log(-math.log(u))) / tau
                        mx = max(x.values())
                        z = sum(math.exp(v - mx) for v in x.values())
                        for j in js:
                            out[l, h, j] += math.exp(x[j] - mx) / z
        return torch.from_numpy(out.astype(np.float32))


# ------------------------------------------------------------------------------------------------
# Lock-step driver.
# ------------------------------------------------------------------------------------------------


class Lockstep:
    def __init__(self, policy: str, k: int, ratio: float, L: int, H: int, kind: str, seed: int,
                 max_pos: int, num_spare: int = 0, stacked: bool = False):
        self.policy, self.k, self.L, self.H = policy, k, L, H
        self.stacked = stacked
        self.state = KVBudgetState(KVBudget.create(policy, k, ratio), L, H, num_spare=num_spare)
        s, w, by = ref_rule(policy, k, ratio)
        self.sinks, self.recent = s, w
        self.ref = [[RefHead(k, s, w, by) for _ in range(H)] for _ in range(L)]
        self.src = ScoreSource(kind, L, H, max_pos, seed)
        self.max_pos = max_pos
        self.seen_dropped: list[list[set[int]]] = [[set() for _ in range(H)] for _ in range(L)]

    def held_mask(self) -> torch.Tensor:  # [L, H, max_pos] bool, from the reference
        m = torch.zeros(self.L, self.H, self.max_pos, dtype=torch.bool)
        for l in range(self.L):
            for h in range(self.H):
                for p in self.ref[l][h].S:
                    m[l, h, p] = True
        return m

    def forward(self, query_positions: list[int], tau: float) -> None:
        f = self.src.forward(query_positions, tau, self.held_mask())  # [L, H, max_pos]
        st = self.state
        slot_scores = f.gather(-1, st.positions.clamp(min=0))
        pad = torch.full((self.L, self.H, 3), 123.0)  # batch padding: must be ignored
        st.accumulate(torch.cat([slot_scores, pad], dim=-1))
        for l in range(self.L):
            for h in range(self.H):
                self.ref[l][h].add_scores({p: float(f[l, h, p]) for p in self.ref[l][h].S})

    def check(self) -> None:
        st = self.state
        pos, sc = st.positions, st.scores
        assert pos.shape == (self.L, self.H, st.num_slots)
        assert bool((pos >= 0).all()), "slots 0..num_slots-1 must all be occupied"
        for l in range(self.L):
            for h in range(self.H):
                ref = self.ref[l][h]
                got = {int(p): sc[l, h, s].item() for s, p in enumerate(pos[l, h].tolist())}
                assert set(got) == set(ref.S), (l, h, sorted(got), sorted(ref.S))
                for p, v in got.items():
                    assert v == float(ref.S[p]), (l, h, p, v, ref.S[p])
                # A dropped token never returns; sinks are never dropped.
                assert not (set(got) & self.seen_dropped[l][h])
                self.seen_dropped[l][h] |= ref.dropped
                if self.policy == "streaming_llm":
                    assert all(p in got for p in range(min(self.sinks, st.num_tokens)))
        # The recent window is always held (every head).
        newest = st.num_tokens - 1
        for p in range(max(0, newest - self.recent + 1), newest + 1):
            assert bool((pos == p).any(-1).all()), f"recent position {p} missing"
        if self.policy == "window" and st.num_slots == self.k:
            assert bool((pos % self.k == torch.arange(self.k)).all()), "ring: slot = p mod k"
        assert st.num_evicted == len(self.ref[0][0].dropped)

    def prompt(self, chunks: list[int]) -> None:
        start = 0
        for c in chunks:
            slots = self.state.append(c)
            assert slots.tolist() == list(range(start, start + c))
            for row in self.ref:
                for r in row:
                    for p in range(start, start + c):
                        r.add(p)
            self.forward(list(range(start, start + c)), 1.0)
            start += c
        self.check()
        old_pos = self.state.positions.clone()
        keep = self.state.select_prompt()
        n = start
        for row in self.ref:
            for r in row:
                r.keep_top(self.k, n - 1, self.sinks, self.recent)
        assert keep.shape[-1] == min(self.k, n)
        assert torch.equal(old_pos.gather(-1, keep), self.state.positions)
        self.check()

    def decode(self, steps: int, max_tokens: int) -> None:
        for t in range(steps):
            p = self.state.num_tokens
            before = self.state.positions.clone()
            slots = choose_victims_batch([self.state], stacked=self.stacked)[0]
            assert slots.shape == (self.L, self.H)
            for l in range(self.L):
                for h in range(self.H):
                    victim = self.ref[l][h].decode(p)
                    s = int(slots[l, h])
                    if victim is None:
                        assert s == before.shape[-1], "under budget: a fresh slot"
                    else:
                        assert int(before[l, h, s]) == victim, (l, h, s, victim)
            tau = 1.0 + t * (2.0 - 1.0) / max_tokens  # τ_init + t·Δτ
            assert keyformer_tau(t, max_tokens) == pytest.approx(tau)
            self.forward([p], tau)
            self.check()


def _kind(policy: str, mode: str) -> str:
    if mode == "int" or policy in ("window", "streaming_llm"):
        return "int"
    return score_mode(policy) or "int"


# ------------------------------------------------------------------------------------------------
# Tests.
# ------------------------------------------------------------------------------------------------


def test_enum_modes_and_helpers() -> None:
    assert [p.value for p in KVPolicy] == ["full", "window", "streaming_llm", "h2o", "keyformer"]
    assert score_mode("keyformer") == "gumbel" and score_mode(KVPolicy.H2O) == "softmax"
    assert score_mode("window") is None and score_mode("full") is None
    assert score_mode("streaming_llm") is None
    assert keyformer_tau(0, 10) == 1.0 and keyformer_tau(5, 10) == 1.5
    assert keyformer_tau(4, 8, 1.0, 3.0) == 2.0
    assert recent_window(10, 0.3) == 3 and recent_window(5, 0.5) == 3  # halves round up
    assert recent_window(4, 0.0) == 0 and recent_window(4, 1.0) == 4
    spec = KVBudget.create("streaming_llm", 10)
    assert (spec.num_sinks, spec.num_recent) == (4, 6)
    assert KVBudget.create("streaming_llm", 3).num_sinks == 2
    assert KVBudget.create("full", 10).budget is None
    assert KVBudget.create("keyformer", None).policy is KVPolicy.FULL


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", ["int", "attn"])
@pytest.mark.parametrize("stacked", [False, True])
def test_policy_matches_reference_fixed(policy: str, mode: str, stacked: bool) -> None:
    """A hand-picked case per policy: prompt in two chunks, then decoding past the budget."""
    k, n, steps = 7, 12, 10
    run = Lockstep(policy, k, 0.3, L=2, H=2, kind=_kind(policy, mode), seed=7, max_pos=n + steps,
                   stacked=stacked)
    run.prompt([5, 7])
    run.decode(steps, max_tokens=steps)


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(POLICIES),
    k=st.integers(1, 9),
    ratio=st.sampled_from([0.0, 0.2, 0.3, 0.5, 1.0]),
    n=st.integers(1, 14),
    steps=st.integers(0, 12),
    L=st.integers(1, 2),
    H=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    chunk=st.integers(1, 6),
    stacked=st.booleans(),
)
def test_policy_matches_reference_random(policy, k, ratio, n, steps, L, H, seed, chunk,
                                         stacked) -> None:
    """Random integer scores (frequent ties) across many shapes and budgets, through both the
    stacked batched call and the per-sequence one."""
    run = Lockstep(policy, k, ratio, L, H, kind="int", seed=seed, max_pos=n + steps,
                   stacked=stacked)
    run.prompt([min(chunk, n - i) for i in range(0, n, chunk)])
    run.decode(steps, max_tokens=max(1, steps))


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["h2o", "keyformer"]),
    k=st.integers(2, 8),
    n=st.integers(2, 10),
    steps=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_score_policies_with_attention_scores(policy, k, n, steps, seed) -> None:
    """Softmax (H2O) and Gumbel-softmax with the τ schedule (Keyformer), fixed uniforms."""
    run = Lockstep(policy, k, 0.3, 2, 2, kind=_kind(policy, "attn"), seed=seed, max_pos=n + steps)
    run.prompt([n])
    run.decode(steps, max_tokens=steps + 3)


@pytest.mark.parametrize("policy", POLICIES + ["full"])
def test_budget_at_least_length_never_evicts(policy: str) -> None:
    n, steps = 6, 8
    st_ = KVBudgetState(KVBudget.create(policy, n + steps), 2, 2)
    st_.append(n)
    st_.accumulate(torch.rand(2, 2, n))
    assert torch.equal(st_.select_prompt(), torch.arange(n).expand(2, 2, n))
    for p in range(n, n + steps):
        assert bool((st_.choose_victims() == p).all())
        st_.accumulate(torch.rand(2, 2, p + 1))
    assert st_.num_evicted == 0 and st_.num_slots == n + steps
    assert torch.equal(st_.positions, torch.arange(n + steps).expand(2, 2, -1))


def test_window_is_a_ring_buffer() -> None:
    k = 5
    st_ = KVBudgetState(KVBudget.create("window", k), 1, 3)
    st_.append(13)
    keep = st_.select_prompt()
    assert keep[0, 0].tolist() == [10, 11, 12, 8, 9]  # position p -> slot p mod k
    for p in range(13, 40):
        slots = st_.choose_victims()
        assert bool((slots == p % k).all())
    assert bool((st_.positions % k == torch.arange(k)).all())
    # Short prompt: fresh slots first, then the ring continues seamlessly.
    st2 = KVBudgetState(KVBudget.create("window", k), 1, 1)
    st2.append(2)
    st2.select_prompt()
    assert [int(st2.choose_victims()) for _ in range(8)] == [p % k for p in range(2, 10)]


def test_speculative_spare_slots_evict_down_to() -> None:
    """Target under a budget: K spare slots, evictions applied only after acceptance."""
    rng = random.Random(0)
    for policy in POLICIES:
        for trial in range(6):
            k, K, L, H = rng.randint(3, 8), rng.randint(1, 4), 2, 2
            n = rng.randint(k + 1, 2 * k + 3)
            run = Lockstep(policy, k, 0.3, L, H, kind="int", seed=trial, max_pos=n + 10 * (K + 1),
                           num_spare=K)
            run.prompt([n])
            for _ in range(5):
                st_ = run.state
                p = st_.num_tokens
                run.decode(1, max_tokens=1)  # the certain token: a normal step
                spare = st_.append(K)  # drafts p+1..p+K into spare slots
                assert spare.tolist() == list(range(k, k + K))
                for row in run.ref:
                    for r in row:
                        for q in range(p + 1, p + K + 1):
                            r.add(q)
                run.forward(list(range(p, p + K + 1)), 1.0)
                accepted = rng.randint(0, K)
                before = st_.positions.clone()
                keep = st_.rollback(p + 1 + accepted)
                assert torch.equal(keep, torch.arange(k + accepted).expand(L, H, -1)), "no moves"
                assert torch.equal(st_.positions, before[..., : k + accepted])
                for row in run.ref:
                    for r in row:
                        for q in range(p + 1 + accepted, p + K + 1):
                            del r.S[q]
                keep = st_.evict_down_to()
                for row in run.ref:
                    for r in row:
                        r.keep_top(k, p + accepted, run.sinks, run.recent)
                assert keep.shape[-1] == k
                assert torch.equal(before.gather(-1, keep), st_.positions)
                run.check()


def test_rollback_compacts_and_refuses_uneven() -> None:
    st_ = KVBudgetState(KVBudget.create("h2o", 4, 0.0), 1, 2)
    st_.append(4)
    st_.accumulate(torch.tensor([[[5.0, 1.0, 5.0, 5.0], [1.0, 5.0, 5.0, 5.0]]]))
    st_.select_prompt()
    st_.choose_victims()  # pos 4 replaces pos 1 (head 0) / pos 0 (head 1)
    st_.accumulate(torch.tensor([[[0.0, 0.0, 0.0, 9.0], [0.0, 0.0, 0.0, 9.0]]]))
    st_.choose_victims()  # pos 5: both heads evict pos 4 (S = 0), mid-buffer
    keep = st_.rollback(5)  # drop pos 5: one token per head, wherever it sits
    assert keep.shape[-1] == 3 and st_.num_slots == 3 and st_.num_tokens == 5
    assert bool((st_.positions < 5).all())
    # Heads that evicted different tokens for a later one cannot be rolled back evenly.
    st3 = KVBudgetState(KVBudget.create("h2o", 2, 0.0), 1, 2)
    st3.append(2)
    st3.accumulate(torch.tensor([[[1.0, 2.0], [2.0, 1.0]]]))
    st3.choose_victims()  # pos 2: head 0 evicts pos 0, head 1 evicts pos 1
    st3.accumulate(torch.tensor([[[0.0, 9.0], [0.0, 9.0]]]))  # head 0: S(2)=0, head 1: S(2)=9
    st3.choose_victims()  # pos 3: head 0 evicts pos 2, head 1 evicts pos 0
    assert sorted(st3.positions[0, 0].tolist()) == [1, 3]
    assert sorted(st3.positions[0, 1].tolist()) == [2, 3]
    with pytest.raises(RuntimeError):
        st3.rollback(2)  # head 0 would hold {1}, head 1 nothing


def test_batched_matches_per_sequence_with_mixed_policies() -> None:
    g = torch.Generator().manual_seed(3)
    specs = [KVBudget.create(p, k, 0.3) for p, k in
             [("window", 4), ("h2o", 5), ("keyformer", 6), ("streaming_llm", 6), ("full", 3),
              ("h2o", 20)]]
    a = [KVBudgetState(s, 3, 2) for s in specs]
    b = [KVBudgetState(s, 3, 2) for s in specs]
    for i, (x, y) in enumerate(zip(a, b)):
        n = 3 + 2 * i
        x.append(n), y.append(n)
        sc = torch.randint(0, 3, (3, 2, n), generator=g).float()
        x.accumulate(sc), y.accumulate(sc)
        assert torch.equal(x.select_prompt(), y.select_prompt())
    for _ in range(12):
        batched = choose_victims_batch(a, stacked=True)
        single = torch.stack([s.choose_victims() for s in b])
        assert torch.equal(batched, single)
        width = max(s.num_slots for s in a)
        layer_scores = [torch.randint(0, 3, (len(a), 2, width), generator=g).float()
                        for _ in range(3)]
        step = stack_layer_scores(layer_scores)
        assert step.shape == (len(a), 3, 2, width)
        accumulate_batch(a, step)
        for i, s in enumerate(b):
            s.accumulate(step[i])
    for x, y in zip(a, b):
        assert torch.equal(x.positions, y.positions) and torch.equal(x.scores, y.scores)
        assert x.num_evicted == y.num_evicted
    assert a[4].num_evicted == 0 and a[4].num_slots == 11 + 12  # full never evicts


def test_compaction_map_moves_only_what_it_must() -> None:
    keep_mask = torch.tensor([[[True, False, True, False, True, True]]])
    pos = torch.arange(6).view(1, 1, 6)
    keep = compaction_map(keep_mask, pos)
    assert keep.tolist() == [[[0, 4, 2, 5]]]
    ring = compaction_map(torch.tensor([[[False, False, True, True, True]]]),
                          torch.tensor([[[0, 1, 5, 6, 7]]]), ring=3)
    assert ring.tolist() == [[[3, 4, 2]]]  # positions 6, 7, 5 -> slots 0, 1, 2


def test_device_and_counters() -> None:
    st_ = KVBudgetState(KVBudget.create("keyformer", 4, 0.25), 2, 1, device="cpu")
    st_.append(10)
    st_.accumulate(torch.rand(2, 1, 10))
    st_.select_prompt()
    assert st_.num_slots == 4 and st_.num_evicted == 6 and st_.num_tokens == 10
    for _ in range(3):
        st_.choose_victims()
        st_.accumulate(torch.rand(2, 1, 4))
    assert st_.num_slots == 4 and st_.num_evicted == 9 and st_.num_tokens == 13
    assert st_.stats() == {"kv_tokens_held": 4, "tokens_evicted": 9} and st_.num_held == 4
    assert st_.scores.dtype == torch.float32 and st_.positions.dtype == torch.int64


def test_order_key_is_lexicographic_in_score_then_position() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.cat([torch.randn(300, generator=g) * 10, torch.tensor([0.0, -0.0, 0.0, 1e-30,
                        -1e-30, float("inf"), 3.0, 3.0])])
    positions = torch.randperm(scores.numel(), generator=g)
    keys = order_key(positions, scores).tolist()
    expect = sorted(range(scores.numel()),
                    key=lambda i: (float(scores[i]), int(positions[i])))  # -0.0 == 0.0 here
    assert sorted(range(scores.numel()), key=lambda i: keys[i]) == expect


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    g = torch.Generator().manual_seed(1)
    for policy in POLICIES:
        cpu = KVBudgetState(KVBudget.create(policy, 6, 0.3), 3, 2, num_spare=2)
        gpu = KVBudgetState(KVBudget.create(policy, 6, 0.3), 3, 2, num_spare=2, device="cuda")
        for s in (cpu, gpu):
            s.append(11)
        sc = torch.randint(0, 3, (3, 2, 11), generator=g).float()
        cpu.accumulate(sc), gpu.accumulate(sc.cuda())
        assert torch.equal(cpu.select_prompt(), gpu.select_prompt().cpu())
        for _ in range(9):
            a = choose_victims_batch([cpu])
            b = choose_victims_batch([gpu])  # stacked on CUDA
            assert torch.equal(a, b.cpu())
            sc = torch.randint(0, 3, (3, 2, 6), generator=g).float()
            cpu.accumulate(sc), gpu.accumulate(sc.cuda())
        for s in (cpu, gpu):
            s.append(2)
            s.rollback(s.num_tokens - 1)
        assert torch.equal(cpu.evict_down_to(), gpu.evict_down_to().cpu())
        assert torch.equal(cpu.positions, gpu.positions.cpu())


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["streaming_llm", "h2o", "keyformer"]),  # (window's ring needs all recent)
    n=st.integers(4, 24),
    q=st.integers(1, 8),
    steps=st.integers(0, 5),
    seed=st.integers(0, 10_000),
)
def test_layers_loaded_with_different_counts_even_out_at_prompt_selection(policy, n, q, steps, seed) -> None:
    """A prefix loaded with a different subset per layer (a prefix store's importance load):
    each layer appends the rest of the prompt after its own tokens, accumulates only over the
    slots it holds, and prompt-phase selection brings every layer to k exactly as the
    loop-based reference does per (layer, head); decoding then runs as usual."""
    L, H = 3, 2
    rng = random.Random(seed)
    k = max(1, (n + q) // 2)
    floor = max(0, k - q)
    counts = [rng.randint(floor, n) for _ in range(L)]
    counts[rng.randrange(L)] = n  # some layer loads everything
    spec = KVBudget.create(policy, k, 0.5)
    sinks, recent, by_score = spec.num_sinks, spec.num_recent, spec.by_score
    state = KVBudgetState(spec, L, H)
    positions = torch.full((L, H, n), -1, dtype=torch.long)
    scores = torch.zeros(L, H, n)
    refs = [[RefHead(k, sinks, recent, by_score) for _ in range(H)] for _ in range(L)]
    for layer, c in enumerate(counts):
        held = sorted(rng.sample(range(n), c))
        for h in range(H):
            s = [float(rng.randint(0, 5)) for _ in held]
            positions[layer, h, :c] = torch.tensor(held)
            scores[layer, h, :c] = torch.tensor(s)
            refs[layer][h].S = {p: np.float32(v) for p, v in zip(held, s)}
    state.restore(positions, scores, n)
    assert state.layer_held is not None or len(set(counts)) == 1
    slots = state.append(q)
    if state.layer_held is not None:
        assert slots.tolist() == [[c + i for i in range(q)] for c in counts]
    for layer in range(L):
        for h in range(H):
            for p in range(n, n + q):
                refs[layer][h].add(p)
    step = torch.tensor([[[float(rng.randint(0, 5)) for _ in range(state.num_slots + 3)]
                          for _ in range(H)] for _ in range(L)])
    state.accumulate(step)
    for layer in range(L):
        for h in range(H):
            ref = refs[layer][h]
            slot_of = {int(p): i for i, p in enumerate(state.positions[layer, h].tolist()) if p >= 0}
            ref.add_scores({p: float(step[layer, h, slot_of[p]]) for p in ref.S})
            assert len(slot_of) == counts[layer] + q
    state.select_prompt()
    assert state.layer_held is None and state.num_slots == k
    for t in range(steps + 1):
        for layer in range(L):
            for h in range(H):
                ref = refs[layer][h]
                if t == 0:
                    ref.keep_top(k, n + q - 1, sinks, recent)
                held = {int(p): float(s) for p, s in zip(state.positions[layer, h].tolist(),
                                                         state.scores[layer, h].tolist())}
                assert held == {p: float(v) for p, v in ref.S.items()}
        if t == steps:
            break
        state.choose_victims()
        for layer in range(L):
            for h in range(H):
                refs[layer][h].decode(n + q + t)
        step = torch.tensor([[[float(rng.randint(0, 5)) for _ in range(state.num_slots)]
                              for _ in range(H)] for _ in range(L)])
        state.accumulate(step)
        for layer in range(L):
            for h in range(H):
                slot_of = {int(p): i for i, p in enumerate(state.positions[layer, h].tolist())}
                refs[layer][h].add_scores({p: float(step[layer, h, slot_of[p]]) for p in refs[layer][h].S})


def test_uneven_layers_below_the_budget_are_refused() -> None:
    """Loading fewer than k - (rest of the prompt) tokens in a layer would leave it short of k
    after the prompt: selection refuses rather than decode with uneven layers."""
    state = KVBudgetState(KVBudget.create("h2o", 6, 0.5), 2, 1)
    positions = torch.tensor([[[0, 1, 2, 3]], [[0, 2, -1, -1]]])
    state.restore(positions, torch.zeros(2, 1, 4), 4)
    state.append(3)
    with pytest.raises(RuntimeError, match="fewer tokens than the budget"):
        state.select_prompt()


# ------------------------------------------------------------------ scoring options (TOVA's)
def test_scoring_options_ride_on_the_budget_of_scoring_policies_only() -> None:
    b = KVBudget.create("keyformer", 40, 0.25, score_window="last", score_pooling="layer")
    assert (b.score_window, b.score_pooling, b.last_query_only, b.pools_layer) == ("last", "layer", True, True)
    assert b.with_budget(20) == KVBudget.create("keyformer", 20, 0.25, "last", "layer")  # kept at another k
    for policy in ("window", "streaming_llm"):  # no scores: the options mean nothing there
        plain = KVBudget.create(policy, 40, 0.25, score_window="last", score_pooling="layer")
        assert (plain.score_window, plain.score_pooling, plain.last_query_only, plain.pools_layer) == (
            "all", "kv_head", False, False)
    assert not KVBudget.create("h2o", 40).last_query_only  # the defaults are H2O's and Keyformer's own
    with pytest.raises(ValueError, match="score_window"):
        KVBudget.create("h2o", 40, score_window="first")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="score_pooling"):
        KVBudget.create("h2o", 40, score_pooling="head")  # type: ignore[arg-type]


def test_last_query_window_replaces_the_scores_instead_of_adding() -> None:
    """``score_window="last"``: S is the newest forward's attention alone (TOVA); the default adds."""
    first = torch.tensor([[[0.5, 0.2, 0.3]]])
    second = torch.tensor([[[0.1, 0.6, 0.3]]])
    for window, want in (("all", first + second), ("last", second)):
        state = KVBudgetState(KVBudget.create("h2o", 8, 0.0, score_window=window), 1, 1)
        state.append(3)
        state.accumulate(first)
        state.accumulate(second)
        torch.testing.assert_close(state.scores, want)


def test_mean_window_ranks_by_the_attention_each_query_gave() -> None:
    """``score_window="mean"`` (kvpress's ObservedAttention): S sums as under "all", but a token
    is ranked by S over the queries that attended it (its own position and every later one).
    An old token that collected a large S from many queries loses to a recent one that every
    query attended strongly; under "all" the old one stays."""
    # positions 0..5 held, 6 queries so far; S: position 1 gathered 2.0 from 5 queries (0.4 each),
    # position 4 gathered 0.9 from 2 queries (0.45 each). (Counting one query too many would
    # flip them: 2.0 / 6 > 0.9 / 3.)
    scores = torch.tensor([[[3.0, 2.0, 2.5, 2.0, 0.9, 5.0]]])
    kept = {}
    for window in ("all", "mean"):
        state = KVBudgetState(KVBudget.create("h2o", 5, 0.0, score_window=window), 1, 1)
        state.append(6)
        state.accumulate(scores)
        ranking = state.ranking(6)
        if window == "mean":
            torch.testing.assert_close(ranking, scores / torch.tensor([6.0, 5, 4, 3, 2, 1]))
        else:
            assert torch.equal(ranking, state.scores)
        state.select_prompt()  # keep 5 of 6
        kept[window] = sorted(state.positions.flatten().tolist())
    assert kept["all"] == [0, 1, 2, 3, 5]  # evicts position 4 (S 0.9)
    assert kept["mean"] == [0, 2, 3, 4, 5]  # evicts position 1 (mean 0.4, the lowest)
    # decode: the victim before writing position 6 is ranked the same way, one step at a time
    state = KVBudgetState(KVBudget.create("h2o", 6, 0.0, score_window="mean"), 1, 1)
    state.append(6)
    state.accumulate(scores)
    assert int(state.choose_victims()[0, 0]) == 1
    state = KVBudgetState(KVBudget.create("h2o", 6, 0.0), 1, 1)
    state.append(6)
    state.accumulate(scores)
    assert int(state.choose_victims()[0, 0]) == 4
    assert KVBudget.create("keyformer", 8, score_window="mean").averages_scores
    assert not KVBudget.create("window", 8, score_window="mean").averages_scores
