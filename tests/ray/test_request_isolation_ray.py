"""The Ray engine isolates a poison request as the in-process engine does: with the KV-block
manager and the target shard as actors, a request whose parameters break the sampler or its
KV-budget state (let past admission by a test hook) fails alone, the others' tokens equal the
in-process engine's, and every block is back in the actor's pool afterwards."""

from __future__ import annotations

import pytest

import keyserve.engine.llm_engine as llm_engine
from keyserve import LLM, SamplingParams
from keyserve.engine.llm_engine import RequestFailedError
from keyserve.llm import RayLLM

pytestmark = pytest.mark.usefixtures("ray_local")

GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
PROMPTS = ["Once upon a time", "Lily and Ben went to the park", "The little dog was sad because",
           "One day, a big red bird", "Mom said"]


def hostile(**fields) -> SamplingParams:
    return SamplingParams.model_construct(**{**SamplingParams().model_dump(), **GREEDY, **fields})


def test_ray_engine_fails_a_poison_alone(stories_path: str, monkeypatch) -> None:
    good = [SamplingParams(**{**GREEDY, "max_tokens": 8 + i}) for i in range(len(PROMPTS))]
    good[1] = SamplingParams(**{**GREEDY, "temperature": 0.9, "seed": 11})
    want = LLM(stories_path, num_blocks=128).generate(PROMPTS, good)
    monkeypatch.setattr(llm_engine, "admit_params", lambda params, limits: params)
    with RayLLM(stories_path, worker_threads=1, num_blocks=128) as ray_llm:
        engine = ray_llm.engine
        good_ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, good)]
        bad = {
            "sampling failed": engine.add_request(PROMPTS[0], hostile(top_k=2**70, temperature=1.0)),
            "KV budget failed": engine.add_request(PROMPTS[2], hostile(kv_policy="h2o", kv_budget=1e18)),
            "stop checks": engine.add_request(PROMPTS[3], hostile(stop_token_ids=None)),
        }
        finished = engine.run_until_done()
        assert [finished[rid].token_ids for rid in good_ids] == [w.token_ids for w in want]
        for stage, rid in bad.items():
            assert isinstance(finished[rid].error, RequestFailedError) and stage in str(finished[rid].error)
        counts = engine.check_consistent()  # raises if a block reference leaked
        assert counts.num_free_blocks == counts.num_blocks and not engine.requests
        [again] = ray_llm.generate(PROMPTS[0], good[0])
        assert again.token_ids == want[0].token_ids


def test_requests_of_the_callers_own_types_cross_to_the_actors(stories_path: str) -> None:
    """A ``SamplingParams`` subclass, a ``str``-subclass request id and ``int``-subclass token
    ids, of classes the actors cannot import (defined here, as in a caller's script), run on the
    default step path (the relay, plain pickles) as in one process. They used to fail their
    whole step there ("the actor closed its step channel"), and every later step with it: the
    engine kept sending the batch that carried them."""

    class MyParams(SamplingParams):
        pass

    class Rid(str):
        pass

    class Tok(int):
        pass

    want = LLM(stories_path, num_blocks=128).generate(PROMPTS[:3], SamplingParams(**GREEDY))
    with RayLLM(stories_path, worker_threads=1, num_blocks=128) as ray_llm:
        engine = ray_llm.engine
        assert engine.relayed
        tokens = [Tok(t) for t in engine.encode_prompt(PROMPTS[1])]
        rids = [
            engine.add_request(PROMPTS[0], MyParams(**GREEDY)),
            engine.add_request(PROMPTS[1], SamplingParams(**GREEDY), request_id=Rid("mine"), prompt_token_ids=tokens),
            engine.add_request(PROMPTS[2], SamplingParams(**GREEDY)),
        ]
        finished = engine.run_until_done()
        assert [finished[rid].token_ids for rid in rids] == [w.token_ids for w in want]
        assert all(finished[rid].error is None for rid in rids)
        [again] = ray_llm.generate(PROMPTS[0], SamplingParams(**GREEDY))
        assert again.token_ids == want[0].token_ids
        counts = engine.check_consistent()
        assert counts.num_free_blocks == counts.num_blocks
