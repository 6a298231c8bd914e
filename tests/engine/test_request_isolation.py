"""One request's bad content fails that request alone (stories260K, in-process engine).

Two lines of defence, each tested on its own: admission (``LLMEngine.add_request``) refuses or
normalises every value the engine cannot use, whoever built the parameters (here with
``SamplingParams.model_construct``, which skips the edge's validation); and, for what admission
did not foresee (here: admission switched off, modelling a forgotten check), the step fails the
request it concerns and nothing else -- its neighbours produce exactly the tokens they produce
alone, and the engine ends with every block, budget state and generator released.
"""

from __future__ import annotations

import math

import pytest

import keyserve.engine.llm_engine as llm_engine
from keyserve import LLM, SamplingParams
from keyserve.engine.errors import InvalidParamError
from keyserve.engine.llm_engine import RequestFailedError, StepFailedError
from helpers.poison import RaisesAfter

GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [
    "Once upon a time",
    "Lily and Ben went to the park to play with a ball",
    "The little dog was sad because",
    "One day, a big red bird",
    "Tom had a toy car. He loved it very much and played with it every day in the garden",
    "Mom said",
]


def hostile(**fields) -> SamplingParams:
    """Parameters the edge never validated (what a forgotten check lets through)."""
    return SamplingParams.model_construct(**{**SamplingParams().model_dump(), **GREEDY, **fields})


@pytest.fixture(scope="module")
def llm(stories_path: str) -> LLM:
    return LLM(stories_path, num_blocks=256, block_size=16, max_num_seqs=32)


@pytest.fixture
def no_admission(monkeypatch):
    """Admission switched off: hostile values reach the step."""
    monkeypatch.setattr(llm_engine, "admit_params", lambda params, limits: params)
    monkeypatch.setattr(llm_engine, "check_token_ids", lambda ids, field, vocab: list(ids))


def solo(llm: LLM, prompt: str, params: SamplingParams) -> list[int]:
    llm.engine.block_manager.reset_prefix_cache()
    [out] = llm.generate(prompt, params)
    assert out.error is None
    return out.token_ids


def assert_clean(llm: LLM) -> None:
    """Nothing of any request is left anywhere in the engine."""
    engine = llm.engine
    assert not engine.requests and not engine._seqs and not engine._seq_owner
    engine.core.check_consistent()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    runner = engine.runner
    assert not runner.budget.states and not runner.generators and not runner.seq_infos


def good_requests() -> list[tuple[str, SamplingParams]]:
    reqs = [(p, SamplingParams(**{**GREEDY, "max_tokens": 8 + 3 * i})) for i, p in enumerate(PROMPTS)]
    reqs += [(p, SamplingParams(**{**GREEDY, "temperature": 0.9, "seed": 100 + i})) for i, p in enumerate(PROMPTS[:3])]
    reqs += [(PROMPTS[1], SamplingParams(**{**GREEDY, "kv_policy": "h2o", "kv_budget": 6}))]
    reqs += [(PROMPTS[4], SamplingParams(**{**GREEDY, "n": 2, "temperature": 0.8, "seed": 7}))]
    return reqs


# ------------------------------------------------------------------------------ admission
NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 2.5), ("n", 33), ("max_tokens", 0), ("max_tokens", 2**70), ("max_tokens", "5"),
    ("temperature", NAN), ("temperature", INF), ("temperature", -1.0), ("temperature", 10**400),
    ("top_k", -1), ("top_k", 1.5), ("top_p", 0.0), ("top_p", NAN), ("top_p", 1.5),
    ("min_p", 2.0), ("min_p", -INF), ("seed", 1.5), ("seed", [1]), ("seed", True),
    ("stop", [123]), ("stop", [""]), ("stop", None),
    ("stop_token_ids", [10**6]), ("stop_token_ids", [-1]), ("stop_token_ids", None), ("stop_token_ids", [2**70]),
    ("ignore_eos", "yes"), ("logprobs", None),
    ("kv_policy", "lru"), ("kv_budget", NAN), ("kv_budget", INF), ("kv_budget", -3.0), ("kv_budget", 7.5),
    ("recent_ratio", NAN), ("recent_ratio", 2.0), ("tau_init", 0.0), ("tau_end", INF),
    ("speculative", True), ("speculative", "yes"), ("num_speculative_tokens", 0),
    ("num_speculative_tokens", 10**9),
])
def test_admission_refuses_what_the_engine_cannot_use(llm: LLM, field: str, value) -> None:
    with pytest.raises(InvalidParamError) as info:
        llm.engine.add_request("Once upon a time", hostile(**{field: value}))
    assert info.value.param == field and field in str(info.value)
    assert len(str(info.value)) < 300  # a 400-digit integer is described, not printed
    assert_clean(llm)


def test_admission_checks_token_ids(llm: LLM) -> None:
    engine = llm.engine
    for ids in ([5, 10**6], [5, -1], [5, 2.5], [5, True]):
        with pytest.raises(InvalidParamError, match="prompt"):
            engine.add_request(ids)
    with pytest.raises(InvalidParamError, match="forced_token_ids"):
        engine.add_request("Once", forced_token_ids=[3, 10**6])
    with pytest.raises(InvalidParamError, match="tau_end"):
        engine.add_request("Once", hostile(tau_init=3.0, tau_end=2.0))
    assert_clean(llm)


def test_values_that_mean_an_in_range_value_are_normalised(llm: LLM) -> None:
    """top_k past the vocabulary keeps every token, a budget past the context evicts nothing,
    a seed outside 64 bits is reduced: each runs exactly as its in-range equivalent."""
    sampled = {"temperature": 1.0, "seed": 3}
    pairs = [
        (hostile(top_k=2**70, **sampled), SamplingParams(**{**GREEDY, **sampled})),
        (hostile(top_k=llm.engine.vocab_size, **sampled), SamplingParams(**{**GREEDY, **sampled})),
        (hostile(kv_policy="h2o", kv_budget=1e18), SamplingParams(**GREEDY)),
        (hostile(seed=2**80 + 5, temperature=1.0), SamplingParams(**{**GREEDY, "temperature": 1.0,
                                                                    "seed": (2**80 + 5) % 2**63})),
        (hostile(seed=-1, temperature=1.0), SamplingParams(**{**GREEDY, "temperature": 1.0, "seed": 2**63 - 1})),
    ]
    for odd, plain in pairs:
        assert solo(llm, PROMPTS[0], odd) == solo(llm, PROMPTS[0], plain)
    assert_clean(llm)


# ------------------------------------------------------------------- past admission: the step
POISONS = {  # name -> (params, the stage named in its error)
    "top_k": (lambda: hostile(top_k=2**70, temperature=1.0), "sampling failed"),
    "n2_top_k": (lambda: hostile(n=2, top_k=2**70, temperature=1.0), "sampling failed"),
    "kv_budget": (lambda: hostile(kv_policy="h2o", kv_budget=1e18), "KV budget failed"),
    "keyformer_budget": (lambda: hostile(kv_policy="keyformer", kv_budget=2**62), "KV budget failed"),
    "seed": (lambda: hostile(seed=[1], temperature=1.0), "seed failed"),
    "stop_token_ids": (lambda: hostile(stop_token_ids=None), "stop checks"),
    "mid_stream": (lambda: hostile(stop_token_ids=RaisesAfter(4)), "stop checks"),
}


def test_poison_past_admission_fails_alone(llm: LLM, no_admission) -> None:
    """Every kind of poison in one batch with good requests (greedy, seeded sampling, a KV
    budget, n = 2): the poisons fail with errors naming the stage, the others' tokens are
    exactly those they produce alone."""
    good = good_requests()
    alone = [solo(llm, p, sp) for p, sp in good]  # for n = 2: sample 0 (all samples checked below)
    engine = llm.engine
    good_ids = [engine.add_request(p, sp) for p, sp in good]
    bad_ids = {name: engine.add_request(PROMPTS[i % len(PROMPTS)], make())
               for i, (name, (make, _)) in enumerate(POISONS.items())}
    forced = engine.add_request(PROMPTS[2], forced_token_ids=[5, 10**6])
    finished = engine.run_until_done()
    for rid, (prompt, params), tokens in zip(good_ids, good, alone):
        out = finished[rid]
        assert out.error is None and out.finish_reason == "length"
        assert out.token_ids == tokens, (prompt, params)
        if params.n > 1:
            engine.block_manager.reset_prefix_cache()
            [ref] = llm.generate(prompt, params)
            assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref.outputs]
    for name, rid in bad_ids.items():
        out = finished[rid]
        assert out.finished and out.finish_reason == "abort", name
        assert isinstance(out.error, RequestFailedError), name
        assert POISONS[name][1] in str(out.error) and rid in str(out.error), (name, out.error)
    assert len(finished[bad_ids["mid_stream"]].token_ids) == 5  # the 5th token's stop check broke
    assert "forced token failed" in str(finished[forced].error)
    assert_clean(llm)
    assert solo(llm, *good[0]) == alone[0]  # and it carries on


def test_seeded_neighbours_draw_the_same_when_the_batch_fails_after_its_draws(llm: LLM, no_admission) -> None:
    """A poison that breaks sampling only after every row drew (a fractional ``top_logprobs``
    breaks the top-logprobs stage, which runs after the draws): the batch's draws are thrown
    away and every row samples alone. Seeded neighbours (n = 1 and n = 2) must draw again from
    where the batch found their generators, so their tokens equal their solo runs; without the
    rewind each would draw its second sample of that step instead."""
    seeded = [(PROMPTS[0], SamplingParams(**{**GREEDY, "temperature": 3.0, "seed": 11})),
              (PROMPTS[3], SamplingParams(**{**GREEDY, "temperature": 3.0, "seed": 12, "n": 2}))]
    alone = [[o.token_ids for o in llm.generate(p, sp)[0].outputs] for p, sp in seeded]
    llm.engine.block_manager.reset_prefix_cache()
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in seeded]
    bad = engine.add_request(PROMPTS[1], hostile(top_logprobs=1.5, temperature=1.0))
    finished = engine.run_until_done()
    assert [[o.token_ids for o in finished[rid].outputs] for rid in ids] == alone
    assert "sampling failed" in str(finished[bad].error)
    assert_clean(llm)


def test_a_fault_outside_every_request_fails_that_step_only(stories_path: str) -> None:
    """A fault in the forward itself (injected: nothing in a request can cause one) fails the
    requests of that step, leaves the engine consistent, and a request that was waiting
    meanwhile runs on to its solo output."""
    llm = LLM(stories_path, num_blocks=128, max_num_seqs=2)
    engine = llm.engine
    params = SamplingParams(**GREEDY)
    waiting_alone = solo(llm, PROMPTS[3], params)
    running = [engine.add_request(p, params) for p in PROMPTS[:2]]
    waiting = engine.add_request(PROMPTS[3], params)
    engine.step()
    real = engine.runner.forward_logits

    def broken(*args, **kwargs):
        engine.runner.forward_logits = real
        raise RuntimeError("device fault")

    engine.runner.forward_logits = broken
    with pytest.raises(StepFailedError, match="device fault") as info:
        engine.step()
    assert sorted(info.value.request_ids) == sorted(running)
    assert [o.finish_reason for o in info.value.outputs] == ["abort", "abort"]
    assert set(engine.requests) == {waiting}
    engine.core.check_consistent()
    finished = engine.run_until_done()
    assert finished[waiting].token_ids == waiting_alone
    assert_clean(llm)


def test_speculative_poison_fails_alone(stories_path: str, draft_dir: str, no_admission) -> None:
    """With a draft: a seed only the draft cannot use breaks the batched drafting (then each
    sequence drafts alone, and that one is verified without drafts: slower, not failed); a
    sampling poison fails alone. The others' greedy tokens are exactly the target's alone."""
    llm = LLM(stories_path, num_blocks=256, draft=draft_dir, num_speculative_tokens=3)
    params = SamplingParams(**{**GREEDY, "speculative": True})
    alone = [solo(llm, p, params) for p in PROMPTS]
    engine = llm.engine
    good = [engine.add_request(p, params) for p in PROMPTS]
    undraftable = engine.add_request(PROMPTS[1], hostile(seed=1.5, temperature=1.0, speculative=True))
    bad = engine.add_request(PROMPTS[0], hostile(top_k=2**70, temperature=1.0, speculative=True))
    finished = engine.run_until_done()
    assert [finished[rid].token_ids for rid in good] == alone
    assert sum(finished[rid].stats.spec_accepted_tokens for rid in good) > 0
    slow = finished[undraftable]
    assert slow.error is None and len(slow.token_ids) == GREEDY["max_tokens"]
    assert slow.stats.spec_draft_tokens == 0
    assert "sampling failed" in str(finished[bad].error)
    assert_clean(llm)
    drafter = engine.drafter
    assert not drafter.mirrors and drafter.block_manager.num_free_blocks == drafter.block_manager.num_blocks
