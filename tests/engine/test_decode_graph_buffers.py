"""The CUDA-graph runner's static buffers on the CPU: copying each step into them, padding to
the bucket, and reading the rows back.

The recording itself needs CUDA (tests/engine/test_cuda_engine.py replays real graphs on a
GPU); here ``_capture`` re-runs the same forward over the static buffers instead of replaying
a recording, so everything the graphs add around the recording is checked against the plain
engine on every CI run.
"""

from __future__ import annotations

import pytest
import torch

from keyserve import LLM, SamplingParams
from keyserve.engine.cuda_graphs import DecodeGraphs

PROMPTS = [
    "Once upon a time there was a little girl named Lily.",
    "The dog ran to the park and",
    "Tom had a big red ball. He liked to play with it every day, and one day his friend Sue came to",
    "One day,",
    "The sun was shining and the birds were singing.",
    "A cat sat on a mat",
]


class Rerun(DecodeGraphs):
    """Replay = run the forward again over the static buffers (the CPU has no graphs)."""

    def _capture(self, forward):  # noqa: ANN001, ANN202
        out = forward()
        return (lambda: out.copy_(forward())), out


@pytest.fixture(scope="module")
def pair(stories_path: str) -> tuple[LLM, LLM]:
    plain = LLM(stories_path, device="cpu", num_blocks=512, block_size=16)
    buffered = LLM(stories_path, device="cpu", num_blocks=512, block_size=16)
    r = buffered.engine.runner
    r.graphs = Rerun(r.model, r.logits_fn, r.kv_caches, 32, 256, torch.device("cpu"), None)
    return plain, buffered


def test_padded_buckets_give_the_plain_engine_tokens(pair: tuple[LLM, LLM]) -> None:
    """Six requests of different lengths: the batch shrinks through buckets 8, 4, 2 and each
    padded step matches the plain step (padding rows write nothing, stale rows are refreshed)."""
    plain, buffered = pair
    lengths = [5, 40, 17, 33, 8, 40]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True) for n in lengths]
    for a, b in zip(plain.generate(PROMPTS, params), buffered.generate(PROMPTS, params)):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.outputs[0].logprobs), torch.tensor(b.outputs[0].logprobs),
                                   atol=2e-4, rtol=0)
    graphs = buffered.engine.runner.graphs
    assert {2, 4, 8} <= set(graphs.graphs) and not graphs.eager


def test_seeded_sampling_and_scored_steps(pair: tuple[LLM, LLM]) -> None:
    """Seeded sampling reads the same rows; steps with KV-budget scores stay off the graphs
    and still agree."""
    plain, buffered = pair
    sampled = [SamplingParams(max_tokens=12, temperature=0.9, seed=i, ignore_eos=True) for i in range(4)]
    for a, b in zip(plain.generate(PROMPTS[:4], sampled), buffered.generate(PROMPTS[:4], sampled)):
        assert a.token_ids == b.token_ids
    h2o = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, kv_policy="h2o", kv_budget=16)
    for a, b in zip(plain.generate(PROMPTS[:3], h2o), buffered.generate(PROMPTS[:3], h2o)):
        assert a.token_ids == b.token_ids


def test_draft_and_verification_steps_through_the_buffers(stories_path: str, draft_dir: str,
                                                          pair: tuple[LLM, LLM]) -> None:
    """Speculative decoding with both the draft's K forwards and the target's verification rows
    going through graph buffers: still the target's greedy tokens."""
    plain, _ = pair
    spec = LLM(stories_path, device="cpu", num_blocks=512, block_size=16, draft=draft_dir, num_speculative_tokens=3)
    runners = (spec.engine.runner, spec.engine.speculative.drafter.runner)
    for r in runners:
        r.graphs = Rerun(r.model, r.logits_fn, r.kv_caches, 32, 256, torch.device("cpu"), None)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for a, b in zip(plain.generate(PROMPTS[:3], params), spec.generate(PROMPTS[:3], params)):
        assert a.token_ids == b.token_ids
    assert spec.engine.speculative.stats.num_draft_tokens > 0
    for r in runners:
        assert r.graphs.graphs and not r.graphs.eager


def test_enforce_eager_and_cpu_build_no_graphs(stories_path: str) -> None:
    from keyserve.config import EngineConfig
    from keyserve.engine import build

    assert build.graph_rows(EngineConfig.from_flat(enforce_eager=True)) == 0
    assert build.graph_rows(EngineConfig.from_flat()) == build.GRAPH_ROWS
    llm = LLM(stories_path, device="cpu", num_blocks=64, block_size=16)
    assert llm.engine.runner.graphs is None  # graphs are CUDA's only
