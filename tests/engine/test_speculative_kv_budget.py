"""Speculative sampling with a KV budget on the draft (stories260K target, a perturbed copy as
the draft): greedy output stays the target's token for token under every draft policy, the
draft's memory stays bounded by its budget plus the spare slots of one speculation, its pool
returns to fully free, and a budgeted mirror never keeps the KV of a rejected draft token."""

from __future__ import annotations

import random

import pytest
import torch

from keyserve import LLM, SamplingParams
from keyserve.engine.kv_budget import physical_slots

WORDS = "once upon a time there was a little girl named lily she loved to play outside in the park".split()
POLICIES = ["window", "streaming_llm", "h2o", "keyformer"]
DRAFT_BUDGET = 6  # tokens per (layer, kv-head): below most prompts' length
BLOCK = 8


def _prompts(count: int) -> list[str]:
    rng = random.Random(7)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def target(stories_path: str) -> LLM:
    return LLM(stories_path, num_blocks=400, block_size=BLOCK)


_ENGINES: dict[str, LLM] = {}


@pytest.fixture()
def budgeted_draft(stories_path: str, draft_dir: str):
    def make(policy: str) -> LLM:
        if policy not in _ENGINES:
            _ENGINES[policy] = LLM(stories_path, num_blocks=400, block_size=BLOCK, draft=draft_dir,
                                   draft_kv_policy=policy, draft_kv_budget=DRAFT_BUDGET)
        return _ENGINES[policy]

    yield make


def _run_checking_bounds(llm: LLM, prompts: list[str], params: list[SamplingParams], k: int) -> list:
    """Step the engine; after every step each budgeted mirror holds at most k + K + 1 slots
    (k kept + one catch-up token + K − 1 computed drafts) and the blocks for them."""
    engine = llm.engine
    drafter = engine.speculative.drafter
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    max_held = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        for target_id, mirror in drafter.mirrors.items():
            state = drafter.runner.budget.states.get(mirror.seq_id)
            if state is None:
                continue
            lookahead = engine._seqs[target_id].params.num_speculative_tokens
            bound = k + lookahead + 1
            assert state.num_slots <= bound
            assert len(mirror.block_table) <= -(-bound // BLOCK)
            max_held = max(max_held, state.num_slots)
    assert max_held > k  # spare slots were really used
    return [done[i] for i in ids]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("num_spec", [1, 3, 5])
def test_greedy_with_budgeted_draft_equals_target(target: LLM, budgeted_draft, policy: str, num_spec: int) -> None:
    prompts = _prompts(8)
    lengths = [24 + (i * 7) % 20 for i in range(len(prompts))]
    alone = target.generate(prompts, [_greedy(n) for n in lengths])
    llm = budgeted_draft(policy)
    params = [_greedy(n, num_speculative_tokens=num_spec) for n in lengths]
    outs = _run_checking_bounds(llm, prompts, params, DRAFT_BUDGET)
    for a, b in zip(alone, outs):
        assert b.token_ids == a.token_ids, f"{policy} K={num_spec}"
    assert sum(o.stats.spec_draft_tokens for o in outs) > 0
    assert sum(o.stats.spec_accepted_tokens for o in outs) > 0
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    drafter = engine.speculative.drafter
    assert drafter.block_manager.num_free_blocks == drafter.block_manager.num_blocks
    assert not drafter.mirrors and not drafter.runner.budget.states and not drafter.runner.seq_infos


def _layer0_keys(fresh: LLM, tokens: list[int]) -> torch.Tensor:  # [num_tokens, kv_heads, head_dim]
    """Layer-0 keys depend only on (token, position): a full-cache forward gives the truth."""
    from keyserve.kernels.reference import gather_kv

    fe = fresh.engine
    fid = fe.add_request(tokens, _greedy(1), prompt_token_ids=tokens)
    fseq = fe.requests[fid].seqs[0]
    fe.runner.execute(fe.core.schedule().step)  # the prompt's forward (and its one sample)
    k_cache = fe.runner.kv_caches[0][0]
    keys = gather_kv(k_cache, torch.tensor([fseq.block_table], dtype=torch.int32), len(tokens))
    fe.abort(fid)
    return keys.reshape(len(tokens), k_cache.shape[2], k_cache.shape[3])


@pytest.mark.parametrize("policy", ["window", "h2o"])
def test_budgeted_mirror_holds_only_valid_tokens(budgeted_draft, draft_dir: str, policy: str) -> None:
    """After every step each kept or spare slot of a mirror holds the K/V of the mirror's own
    token at the slot's position (positions unique per head): rejected drafts of earlier steps
    are gone, not relabelled; layer 0 is checked against a full-cache draft forward."""
    llm = budgeted_draft(policy)
    engine = llm.engine
    drafter = engine.speculative.drafter
    # the draft's own dtype (bf16 under a float32 target on the CPU: draft_dtype "auto")
    draft_dtype = str(drafter.runner.kv_caches[0][0].dtype).removeprefix("torch.")
    fresh = LLM(draft_dir, num_blocks=64, block_size=BLOCK, enable_prefix_caching=False, dtype=draft_dtype)
    tol = 1e-5 if draft_dtype == "float32" else 0.1  # bf16: a few ulps between decode rows and prefill
    prompt = " ".join(WORDS[:14])
    rid = engine.add_request(prompt, _greedy(40, num_speculative_tokens=4))
    rejected_steps = 0
    while rid in engine.requests:
        before = engine.speculative.stats.num_draft_tokens - engine.speculative.stats.num_accepted_tokens
        engine.step()
        rejected_steps += engine.speculative.stats.num_draft_tokens - engine.speculative.stats.num_accepted_tokens > before
        if rid not in engine.requests:
            break
        seq = engine.requests[rid].seqs[0]
        mirror = drafter.mirrors.get(seq.seq_id)
        state = drafter.runner.budget.states.get(mirror.seq_id) if mirror is not None else None
        if state is None or mirror.kv_slot_cap is None:
            continue
        positions = state.positions[0]  # [H, n] layer 0
        assert (positions.sort(dim=-1).values.diff(dim=-1) > 0).all()  # unique per head
        assert int(positions.max()) < mirror.num_computed_tokens
        want = _layer0_keys(fresh, mirror.token_ids[: mirror.num_computed_tokens])  # [T, H, D]
        k_cache = drafter.runner.kv_caches[0][0]
        rows = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
        table = torch.tensor(mirror.block_table, dtype=torch.int64)
        phys = physical_slots(torch.arange(state.num_slots), table, BLOCK)  # [n]
        heads = torch.arange(positions.shape[0])[:, None]
        got = rows[phys[None, :], heads]  # [H, n, D]
        torch.testing.assert_close(got.float(), want[positions, heads].float(), atol=tol, rtol=tol)
    assert rejected_steps > 0
    assert drafter.block_manager.num_free_blocks == drafter.block_manager.num_blocks


def test_fractional_draft_budget_and_batch_mixing(target: LLM, stories_path: str, draft_dir: str) -> None:
    """A budget given as a share of the prompt, with requests that do and do not speculate."""
    llm = LLM(stories_path, num_blocks=400, block_size=BLOCK, draft=draft_dir, num_speculative_tokens=3,
              draft_kv_policy="keyformer", draft_kv_budget=0.5)
    prompts = _prompts(6)
    params = [_greedy(30, speculative=i % 2 == 0) for i in range(len(prompts))]
    alone = target.generate(prompts, [_greedy(30) for _ in prompts])
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    drafter = llm.engine.speculative.drafter
    assert drafter.block_manager.num_free_blocks == drafter.block_manager.num_blocks


def test_cli_and_serve_flags_reach_the_spec_config() -> None:
    from keyserve.cli import build_parser, engine_config
    from keyserve.cluster.serve_app import ServeArgs
    from keyserve.cluster.serve_cli import build_parser as serve_parser
    from keyserve.cluster.cli_args import model_kwargs

    args = build_parser().parse_args(["generate", "--prompt", "x", "--draft", "d",
                                      "--draft-kv-policy", "keyformer", "--draft-kv-budget", "0.25"])
    spec = engine_config(args).spec
    assert (spec.draft_kv_policy, spec.draft_kv_budget) == ("keyformer", 0.25)
    ns = serve_parser().parse_args(["--draft", "d", "--draft-kv-policy", "h2o", "--draft-kv-budget", "64"])
    spec = ServeArgs(**model_kwargs(ns, ServeArgs)).engine_config().spec
    assert (spec.draft_kv_policy, spec.draft_kv_budget) == ("h2o", 64.0)


def test_mirror_rebuilt_when_target_diverges_below_the_settled_point(budgeted_draft) -> None:
    """Nothing in the engine rewrites accepted tokens, but if the target's tokens ever differ
    below what a budgeted mirror settled (its evicted tokens would be needed), the mirror is
    re-prefilled from the target's tokens instead of keeping stale KV."""
    from keyserve.core.sequence import Sequence

    drafter = budgeted_draft("h2o").engine.speculative.drafter
    target = Sequence("r", list(range(5, 25)), _greedy(30))
    target.output_token_ids = [7, 8, 9]
    drafter.propose([target], [3])
    mirror = drafter.mirrors[target.seq_id]
    settled = drafter.settled[target.seq_id]
    assert mirror.kv_slot_cap == DRAFT_BUDGET and settled == target.num_tokens
    target.output_token_ids = [7, 11, 12, 13]  # differs at a position already settled
    drafter.propose([target], [3])
    state = drafter.runner.budget.states[mirror.seq_id]
    assert drafter.settled[target.seq_id] == target.num_tokens  # re-prefilled and compacted again
    assert int(state.positions.max()) < mirror.num_computed_tokens
    assert state.num_slots <= DRAFT_BUDGET + 3
    drafter.release(target)
    assert drafter.block_manager.num_free_blocks == drafter.block_manager.num_blocks
    assert not drafter.runner.budget.states
