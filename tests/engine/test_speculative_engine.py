"""Speculative sampling in the engine (stories260K target, a perturbed copy as the draft):
greedy output equals the target alone for every K, the sampled distribution equals the
target's, and both caches roll back to exactly the accepted tokens."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from scipy.stats import chi2_contingency

from keyserve import LLM, SamplingParams
from keyserve.kernels.reference import gather_kv

WORDS = "once upon a time there was a little girl named lily she loved to play outside in the park".split()


@pytest.fixture(scope="module")
def target(stories_path: str) -> LLM:
    return LLM(stories_path, num_blocks=400)


@pytest.fixture(scope="module")
def speculative(stories_path: str, draft_dir: str) -> LLM:
    return LLM(stories_path, num_blocks=400, draft=draft_dir, num_speculative_tokens=4)


def _prompts(count: int) -> list[str]:
    rng = random.Random(1)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def test_greedy_equals_target_for_every_k(target: LLM, speculative: LLM) -> None:
    prompts = _prompts(20)
    lengths = [20 + (i * 5) % 30 for i in range(20)]
    alone = target.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths])
    for k in range(1, 9):
        params = [
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, num_speculative_tokens=k)
            for n in lengths
        ]
        outs = speculative.generate(prompts, params)
        for a, b in zip(alone, outs):
            assert b.token_ids == a.token_ids, f"K={k}"
        rates = [o.stats.spec_acceptance_rate for o in outs]
        assert 0.0 < sum(rates) / len(rates) < 1.0  # some drafts rejected, some accepted
    engine = speculative.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    drafter = engine.speculative.drafter
    assert drafter.block_manager.num_free_blocks == drafter.block_manager.num_blocks
    assert not drafter.mirrors


def test_stop_inside_an_accepted_run(target: LLM, speculative: LLM) -> None:
    prompt = "once upon a time"
    [free] = target.generate(prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    stop_token = free.token_ids[7]
    params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_token], num_speculative_tokens=6)
    [spec] = speculative.generate(prompt, params)
    assert spec.token_ids == free.token_ids[: free.token_ids.index(stop_token) + 1]
    [short] = speculative.generate(prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                          num_speculative_tokens=8))
    assert short.token_ids == free.token_ids[:5]


def test_sampled_distribution_equals_target(target: LLM, speculative: LLM) -> None:
    """Second and third tokens (the first ones speculation produces) have the same frequencies
    with and without speculation: a chi-square contingency test."""

    def sample(llm: LLM, spec: bool) -> tuple[Counter, Counter]:
        second, third = Counter(), Counter()
        params = [
            SamplingParams(n=64, max_tokens=3, temperature=1.0, seed=1000 * spec + i, ignore_eos=True,
                           speculative=spec, num_speculative_tokens=2)
            for i in range(40)
        ]
        for out in llm.generate(["once upon a time there was"] * 40, params):
            for o in out.outputs:
                second[o.token_ids[1]] += 1
                third[o.token_ids[2]] += 1
        return second, third

    plain = sample(target, False)
    spec = sample(speculative, True)
    assert speculative.engine.speculative.stats.num_draft_tokens > 0
    for a, b in zip(plain, spec):
        common = [t for t in set(a) | set(b) if a[t] + b[t] >= 20]
        table = [[a[t] for t in common] + [sum(a.values()) - sum(a[t] for t in common)],
                 [b[t] for t in common] + [sum(b.values()) - sum(b[t] for t in common)]]
        if table[0][-1] + table[1][-1] == 0:
            table = [row[:-1] for row in table]
        assert chi2_contingency(table).pvalue > 1e-3


def _cached_kv(llm: LLM, seq, num: int, draft: bool = False) -> list[torch.Tensor]:
    runner = llm.engine.speculative.drafter.runner if draft else llm.engine.runner
    table = torch.tensor([seq.block_table], dtype=torch.int32)
    return [torch.cat([gather_kv(k, table, num), gather_kv(v, table, num)]) for k, v in runner.kv_caches]


def test_rollback_leaves_exactly_the_accepted_kv(speculative: LLM, stories_path: str, draft_dir: str) -> None:
    """After each step the request's acceptance counts equal what its emitted tokens imply (a
    verification of K drafts emits accepted + 1 tokens), the run has both acceptances and
    rejections, and the block table holds exactly the blocks of the computed tokens (rejected
    slots dropped). Mutations caught: ``llm_engine`` recording ``len(item.draft_token_ids)``
    as accepted (the counts), and dropping ``bm.truncate`` after a verification in
    ``KVCore`` (the block table one step later)."""
    engine = speculative.engine
    rid = engine.add_request("lily and ben went to the park", SamplingParams(max_tokens=40, temperature=0.8, seed=6,
                                                                             ignore_eos=True))
    seq = engine.requests[rid].seqs[0]
    emitted = []
    for _ in range(6):
        before = len(seq.output_token_ids)
        engine.step()
        emitted.append(len(seq.output_token_ids) - before)
        assert len(seq.block_table) == -(-seq.num_computed_tokens // 16)
    mirror = engine.speculative.drafter.mirrors[seq.seq_id]
    k = 4  # every step after the prompt verifies 4 drafts (max_tokens leaves room)
    verified = emitted[1:]  # the first step is the prompt's forward: one sampled token
    assert emitted[0] == 1 and all(1 <= e <= k + 1 for e in verified)
    stats = engine.speculative.request_stats[rid]
    assert stats.num_steps == len(verified)
    assert stats.num_draft_tokens == k * len(verified)
    assert stats.num_accepted_tokens == sum(e - 1 for e in verified)
    assert stats.num_rejections == sum(e - 1 < k for e in verified)
    assert stats.num_accepted_tokens > 0 and stats.num_rejections > 0  # both paths ran
    n_target, n_draft = seq.num_computed_tokens, mirror.num_computed_tokens
    got_target = _cached_kv(speculative, seq, n_target)
    got_draft = _cached_kv(speculative, mirror, n_draft, draft=True)
    # On the CPU the draft runs in bfloat16 under the float32 target (draft_dtype "auto"), on a
    # GPU in float32: its fresh recomputation does too, where a stale or misplaced rejected
    # token's K/V would still differ by O(1), far above the rounding between the decode-row and
    # prefill paths (a few bf16 ulps; on a GPU, float32 through different Triton kernels).
    draft_dtype = engine.speculative.drafter.runner.kv_caches[0][0].dtype
    on_gpu = got_target[0].is_cuda
    assert draft_dtype is (torch.float32 if on_gpu else torch.bfloat16)
    f32_tol = 1e-3 if on_gpu else 1e-5
    for fresh_path, tokens, got, dtype, tol in (
            (stories_path, seq.token_ids[:n_target], got_target, "float32", f32_tol),
            (draft_dir, mirror.token_ids[:n_draft], got_draft, str(draft_dtype).removeprefix("torch."),
             f32_tol if on_gpu else 0.1)):
        fresh = LLM(fresh_path, num_blocks=64, enable_prefix_caching=False, dtype=dtype)
        fe = fresh.engine
        fid = fe.add_request(tokens, SamplingParams(max_tokens=1), prompt_token_ids=tokens)
        fseq = fe.requests[fid].seqs[0]
        fe.runner.execute(fe.core.schedule().step)  # the prompt's forward (and its one sample)
        want = _cached_kv(fresh, fseq, len(tokens))
        for a, b in zip(got, want):
            torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
    engine.abort(rid)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    drafter = engine.speculative.drafter
    assert drafter.block_manager.num_free_blocks == drafter.block_manager.num_blocks


def test_adaptive_k_lives_in_the_engines_one_policy(stories_path: str, draft_dir: str, target: LLM) -> None:
    """The KV core holds no speculative policy: every step it reserves exactly the draft counts
    the engine's ``SpeculativeDecoder`` asked for; adaptive K learns from the acceptances the
    engine records (K moves away from the prior's choice), forgets a sequence once it finishes,
    and greedy output stays the target's."""
    llm = LLM(stories_path, num_blocks=400, draft=draft_dir, num_speculative_tokens=8,
              adaptive_k=True, draft_cost_ratio=0.05)
    engine = llm.engine
    policy = engine.speculative
    assert not any(isinstance(v, type(policy)) for v in vars(engine.core).values())
    observe = policy.observe_step  # step times injected (drafts nearly free): K follows α, not the machine
    policy.observe_step = lambda batch, k, seconds, sampled=False, drafting=None, trees=0, copies=0, rows=None: observe(
        batch, k, 1.0 + 0.01 * k, sampled, drafting, trees, copies, rows)
    asked: list[dict[int, int]] = []
    reserved: list[dict[int, int]] = []
    schedule = engine.core.schedule

    def spy(lookahead: dict[int, int] | None = None, multi_step: bool = False):  # the real call's input, output
        reply = schedule(lookahead, multi_step)
        asked.append(dict(lookahead or {}))
        reserved.append({it.seq_id: it.num_lookahead for it in reply.step.items} if reply.step else {})
        return reply

    engine.core.schedule = spy
    prompts = _prompts(6)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    alone = target.generate(prompts, params)
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    decode_steps = [(a, r) for a, r in zip(asked, reserved) if any(r.values())]
    assert decode_steps
    for a, r in decode_steps:
        assert {s: k for s, k in r.items() if k} == {s: a[s] for s, k in r.items() if k}
    # Far from max_tokens (room does not clamp K), K still changes: adaptive K has observed.
    early = {k for a, r in decode_steps[:15] for s, k in r.items() if k}
    assert len(early) > 1, early
    assert not policy._adaptive  # forgotten when the engine finished each sequence


def _exact_first_two(model_dir: str, prompt_ids: list[int], params: SamplingParams) -> dict[tuple[int, int], float]:
    """The target's exact joint q(t1) · q(t2 | t1) after ``prompt_ids`` under ``params``
    (temperature, top-k, top-p), from a dense transformers forward of the same weights and
    keyserve's own processing (``processed_probs``)."""
    from transformers import AutoModelForCausalLM

    from keyserve.core.sampler import SamplingTensors, processed_probs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    st = SamplingTensors.from_params([params])

    def q(ids: list[int]) -> torch.Tensor:  # [vocab]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1:].float()
        return processed_probs(logits, st)[0].double()

    q1 = q(prompt_ids)
    joint = {}
    for t1 in q1.nonzero().flatten().tolist():
        q2 = q(prompt_ids + [t1])
        for t2 in q2.nonzero().flatten().tolist():
            joint[(t1, t2)] = float(q1[t1] * q2[t2])
    return joint


@pytest.mark.parametrize("confidence", [0.0, 0.2], ids=["chains", "confidence-cut"])
def test_sampled_with_top_k_top_p_equals_target_exactly(stories_path: str, draft_dir: str, confidence: float) -> None:
    """Temperature 0.7, top-p 0.9, top-k 50 (what users send): the first two tokens of 20,480
    samples -- the second one from the first speculative step, an accepted draft or a token
    recovered from norm(max(0, q − p)) -- against the target's exact joint q(t1)·q(t2 | t1).

    Power: with N = 20,480 draws a cell's frequency has standard error ≤ √(0.25 / N) = 0.0035,
    so a shift of 0.02 in any cell's probability is ≥ 5.7 standard errors; each cell is tested
    at 4.4 (a 1e-3 family-wise error over ≤ 100 cells), which such a shift exceeds with
    probability ≥ 0.9, and the chi-square over all cells must pass too.

    ``confidence-cut``: chains end where the draft's processed distribution peaks below 0.2
    (``draft_confidence_threshold``), a decision on the distribution alone. Stopping on the
    drawn token's own probability instead would make the proposals no longer distributed as the
    verification assumes: caught here (cell (269, 261): 45 draws for 115 expected, 6.6 standard
    errors). At 0.5 it was not: after this prompt the draft's first distribution rarely peaks
    that high, and where it does not, both rules stop alike."""
    params = SamplingParams(n=64, max_tokens=4, temperature=0.7, top_p=0.9, top_k=50, ignore_eos=True,
                            num_speculative_tokens=2)
    llm = LLM(stories_path, num_blocks=1400, max_num_seqs=512, draft=draft_dir, num_speculative_tokens=2,
              draft_confidence_threshold=confidence)
    prompt = llm.tokenizer.encode("the little dog")
    requests = 320
    outs = llm.generate([prompt] * requests, [params.model_copy(update={"seed": i}) for i in range(requests)])
    stats = llm.engine.speculative.stats
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    doubted = llm.engine.speculative.num_misses  # first drafts the draft doubted (its pool never fills here)
    assert (doubted > 0) == bool(confidence), doubted
    counts = Counter((o.token_ids[0], o.token_ids[1]) for out in outs for o in out.outputs)
    n = sum(counts.values())
    assert n == requests * 64
    exact = _exact_first_two(stories_path, prompt, params)
    assert set(counts) <= set(exact), f"emitted outside the target's support: {set(counts) - set(exact)}"
    assert len(exact) <= 100
    assert_counts_match(counts, exact, n)


def assert_counts_match(counts: Counter, exact: dict[tuple[int, int], float], n: int) -> None:
    """Every cell within 4.4 standard errors of its exact count, and the chi-square over the
    cells (the rare ones pooled) at p > 1e-3 (the power is in the callers' docstrings)."""
    from scipy.stats import chisquare

    cells = sorted(exact)
    observed = [counts.get(c, 0) for c in cells]
    expected = [exact[c] * n for c in cells]
    for cell, o, e in zip(cells, observed, expected):
        p = e / n
        z = (o - e) / math.sqrt(max(n * p * (1 - p), 1e-12))
        assert abs(z) < 4.4, (cell, o, e)
    big = [i for i, e in enumerate(expected) if e >= 5]  # pool the rare cells into one
    obs = [observed[i] for i in big] + [n - sum(observed[i] for i in big)]
    exp = [expected[i] for i in big] + [n - sum(expected[i] for i in big)]
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    # The exact probabilities sum to 1 only up to float rounding (2.5e-8 off on one CPU, past
    # scipy's 1.5e-8 check): scale the expected counts to the observed total.
    scale = sum(obs) / sum(exp)
    assert chisquare(obs, [e * scale for e in exp]).pvalue > 1e-3


def test_a_seeded_sampled_request_is_the_same_alone_or_beside_another_speculating(
        stories_path: str, draft_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded request drafting 2 per step beside a greedy one drafting 4: the same tokens as
    alone (the hostile-input sweep's case; its accept uniforms used to follow the batch's widest
    draft count, and every later draw shifted).

    With the native kernels switched off: what this checks is the draws, and the AVX2 build of
    the native few-row linear rounds a row differently at 1, 2-8 and 9-16 rows (~1e-6 relative:
    its accumulation order follows the call's row count, and beside the partner both the draft's
    and the target's calls have more rows), which on the 2-core EPYC flipped token 24 of 80.
    The AVX-512 build passed this with the kernels on. docs/speculative.md states the limit."""
    from keyserve.kernels import native

    monkeypatch.setenv("KEYSERVE_NATIVE_KERNELS", "0")
    native.library.cache_clear()
    try:
        llm = LLM(stories_path, num_blocks=400, draft=draft_dir, num_speculative_tokens=4, adaptive_k=False)
        assert native.library() is None
        _same_alone_or_batched(llm)
    finally:
        monkeypatch.delenv("KEYSERVE_NATIVE_KERNELS")
        native.library.cache_clear()


def _same_alone_or_batched(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=80, temperature=1.0, seed=1234, num_speculative_tokens=2, ignore_eos=True)
    partner = SamplingParams(max_tokens=200, temperature=0.0, num_speculative_tokens=4, ignore_eos=True)
    [alone] = llm.generate(["Once upon a time"], seeded)
    [again] = llm.generate(["Once upon a time"], seeded)
    batched, _ = llm.generate(["Once upon a time", "The dog"], [seeded, partner])
    assert again.token_ids == alone.token_ids
    assert batched.token_ids == alone.token_ids
