"""The engine on CUDA (Triton kernels end to end) against the same engine on the CPU.

Skipped without a GPU: CI has none. On a lent GPU machine these prove that the compiled
Triton KV write, decode, prefill and score kernels drive real generation to the same tokens as
the CPU path (native C / pure-torch reference), with continuous batching, KV budgets (scores
from the kernels) and speculative sampling.
"""

from __future__ import annotations

import pytest
import torch

from keyserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [
    "Once upon a time there was a little girl named Lily.",
    "The dog ran to the park and",
    "Tom had a big red ball. He liked to play with it every day, and one day his friend Sue came to",
    "One day,",
    "The sun was shining and the birds were singing. Mia went outside to see her friend Ben, who lived next door.",
    "A cat sat on a mat",
]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 48), temperature=0.0, ignore_eos=True,
                          logprobs=True, **kw)


@pytest.fixture(scope="module")
def cpu(stories_path: str) -> LLM:
    return LLM(stories_path, device="cpu", num_blocks=512, block_size=16)


@pytest.fixture(scope="module")
def gpu(stories_path: str) -> LLM:
    return LLM(stories_path, device="cuda", num_blocks=512, block_size=16)


def _same(a, b) -> None:
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(torch.tensor(a.outputs[0].logprobs),
                               torch.tensor(b.outputs[0].logprobs), atol=2e-4, rtol=0)


def test_runs_on_the_gpu(gpu: LLM) -> None:
    runner = gpu.engine.runner
    assert runner.device.type == "cuda"


def test_batched_greedy_equals_cpu(cpu: LLM, gpu: LLM) -> None:
    """Continuous batching of prompts of mixed lengths: every token and logprob as on the CPU."""
    for a, b in zip(gpu.generate(PROMPTS, _greedy()), cpu.generate(PROMPTS, _greedy())):
        _same(a, b)


def test_chunked_prefill_and_prefix_cache_equal_cpu(cpu: LLM, gpu: LLM) -> None:
    long = PROMPTS[4] * 6
    for llm in (cpu, gpu):
        llm.generate(long, _greedy(max_tokens=4))  # fills the prefix cache
    [a] = gpu.generate(long + " Then", _greedy())
    [b] = cpu.generate(long + " Then", _greedy())
    assert a.stats.prefix_cache_hit_tokens > 0
    _same(a, b)


@pytest.mark.parametrize(("policy", "window", "pooling"), [
    ("window", "all", "kv_head"), ("streaming_llm", "all", "kv_head"), ("h2o", "all", "kv_head"),
    ("h2o", "last", "layer"), ("h2o", "all", "layer"), ("h2o", "last", "kv_head")])
def test_kv_budgets_equal_cpu(cpu: LLM, gpu: LLM, policy: str, window: str, pooling: str) -> None:
    """Deterministic policies pick the same victims from the Triton kernels' scores as from the
    CPU path's, so the tokens match; with H2O's scoring options too (the prompt's last token in
    a step of its own, scores pooled per layer on the device)."""
    params = _greedy(kv_policy=policy, kv_budget=24, max_tokens=40, kv_score_window=window, kv_score_pooling=pooling)
    for a, b in zip(gpu.generate(PROMPTS[:3], params), cpu.generate(PROMPTS[:3], params)):
        assert a.stats.kv_tokens_held == b.stats.kv_tokens_held == 24
        assert a.token_ids == b.token_ids


def test_prefix_store_loads_equal_cpu(stories_path: str, tmp_path) -> None:
    """The prefix store with its device tier in CUDA KV blocks: a stored prefix pushed out to host
    and disk loads back into the GPU's blocks, whole under full attention and as its important
    tokens plus the recent window under H2O, and generates what the same store on the CPU does."""
    story = " ".join(PROMPTS[2:5]) * 2
    others = [PROMPTS[0] * 8, PROMPTS[5] * 12]
    h2o = _greedy(kv_policy="h2o", kv_budget=0.5, max_tokens=24)
    outs, stats = {}, {}
    for device in ("cpu", "cuda"):
        llm = LLM(stories_path, device=device, num_blocks=256, block_size=16, enable_prefix_caching=False,
                  prefix_store=True, prefix_store_device_tokens=64, prefix_store_host_tokens=64,
                  prefix_store_disk_path=str(tmp_path / device), prefix_store_top_k_fraction=0.5)
        first = [llm.generate(story, p)[0] for p in (_greedy(max_tokens=2), h2o)]  # stored, then with scores
        for text in others:  # push the story's chunks down the tiers
            llm.generate(text, _greedy(max_tokens=2))
        later = [llm.generate(story + " Then", p)[0] for p in (_greedy(), h2o)]
        outs[device] = first + later
        stats[device] = llm.engine.prefix_store_stats()
        llm.engine.close()
    assert stats["cuda"]["hits"] >= 2 and stats["cuda"]["disk_hits"] > 0
    for key in ("hits", "hit_tokens", "loaded_tokens", "device_hits", "host_hits", "disk_hits"):
        assert stats["cuda"][key] == stats["cpu"][key], key
    for a, b in zip(outs["cuda"], outs["cpu"]):
        assert a.token_ids == b.token_ids


def test_keyformer_holds_its_budget_and_frees_every_block(gpu: LLM) -> None:
    bm = gpu.engine.block_manager
    free = bm.num_free_blocks
    outs = gpu.generate(PROMPTS, _greedy(kv_policy="keyformer", kv_budget=0.5, max_tokens=40))
    for out in outs:
        assert out.stats.kv_tokens_evicted > 0
        assert len(out.token_ids) == 40
    assert bm.num_free_blocks == free


def test_bfloat16_tracks_float32(stories_path: str, gpu: LLM) -> None:
    bf16 = LLM(stories_path, device="cuda", dtype="bfloat16", num_blocks=256, block_size=16)
    a = bf16.generate(PROMPTS, _greedy(max_tokens=16))
    b = gpu.generate(PROMPTS, _greedy(max_tokens=16))
    first = [x.token_ids[0] == y.token_ids[0] for x, y in zip(a, b)]
    assert sum(first) >= len(first) - 1  # bf16 rounding may flip a near-tie, not the model


def test_speculative_greedy_equals_target_alone(stories_path: str, draft_dir: str, gpu: LLM) -> None:
    spec = LLM(stories_path, device="cuda", num_blocks=512, block_size=16, draft=draft_dir,
               num_speculative_tokens=4)
    params = _greedy(max_tokens=40)
    outs = spec.generate(PROMPTS, params)
    for a, b in zip(outs, gpu.generate(PROMPTS, params)):
        assert a.token_ids == b.token_ids
    assert spec.engine.speculative.stats.num_draft_tokens > 0


# ------------------------------------------------------------------ CUDA graphs of decode steps
@pytest.fixture(scope="module")
def eager(stories_path: str) -> LLM:
    return LLM(stories_path, device="cuda", num_blocks=512, block_size=16, enforce_eager=True)


def test_decode_steps_replay_cuda_graphs(gpu: LLM) -> None:
    """Decode steps of the default engine run as recorded graphs (none fell back to eager)."""
    from keyserve.engine.cuda_graphs import BUCKETS

    gpu.generate(PROMPTS, _greedy(max_tokens=8))
    graphs = gpu.engine.runner.graphs
    assert graphs is not None and not graphs.eager
    assert 8 in graphs.graphs  # six sequences decoding together: the 8-row bucket
    assert set(graphs.graphs) <= set(BUCKETS)


def test_cuda_graphs_equal_eager(gpu: LLM, eager: LLM) -> None:
    """Replayed graphs (padded buckets, static buffers) give the eager steps' tokens and
    logprobs: greedy, seeded sampling, and batches that shrink as requests finish."""
    assert eager.engine.runner.graphs is None
    lengths = [5, 40, 17, 33, 8, 40]
    greedy = [_greedy(max_tokens=n) for n in lengths]
    for a, b in zip(gpu.generate(PROMPTS, greedy), eager.generate(PROMPTS, greedy)):
        _same(a, b)
    sampled = [SamplingParams(max_tokens=n, temperature=0.9, top_p=0.95, seed=i, ignore_eos=True)
               for i, n in enumerate(lengths)]
    for a, b, n in zip(gpu.generate(PROMPTS, sampled), eager.generate(PROMPTS, sampled), lengths):
        assert a.token_ids == b.token_ids
        assert len(a.token_ids) == n and a.outputs[0].finish_reason == "length"  # not both failed


def test_speculative_verification_replays_graphs(stories_path: str, draft_dir: str, eager: LLM) -> None:
    """Verification steps (K + 1 decode rows per sequence) go through the graphs too and keep
    speculative greedy equal to the target alone."""
    spec = LLM(stories_path, device="cuda", num_blocks=512, block_size=16, draft=draft_dir,
               num_speculative_tokens=3)
    params = _greedy(max_tokens=24)
    for a, b in zip(spec.generate(PROMPTS[:3], params), eager.generate(PROMPTS[:3], params)):
        assert a.token_ids == b.token_ids
    assert 12 <= max(spec.engine.runner.graphs.graphs)  # 3 sequences x 4 rows


def test_seeded_sampling_on_the_gpu(stories_path: str, draft_dir: str, gpu: LLM) -> None:
    """Seeded requests sample on the GPU with generators on the GPU: every one finishes, the
    same seed gives the same tokens alone and in a batch, n > 1 samples differ, and the
    speculative engine's sampled drafts and verification draw from them too. (Until
    2026-11-27 every seeded request on CUDA failed: its generator was on the CPU.)"""
    def params(seed: int, **kw) -> SamplingParams:
        return SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=seed, ignore_eos=True, **kw)

    [alone] = gpu.generate(PROMPTS[:1], params(3))
    batch = gpu.generate(PROMPTS, [params(3)] + [params(10 + i) for i in range(5)])
    assert len(alone.token_ids) == 24 and batch[0].token_ids == alone.token_ids
    assert all(len(o.token_ids) == 24 for o in batch)
    [many] = gpu.generate(PROMPTS[:1], params(5, n=3))
    assert len({tuple(o.token_ids) for o in many.outputs}) > 1
    assert all(len(o.token_ids) == 24 for o in many.outputs)
    spec = LLM(stories_path, device="cuda", num_blocks=512, block_size=16, draft=draft_dir,
               num_speculative_tokens=3)
    first = spec.generate(PROMPTS, [params(20 + i) for i in range(6)])
    again = spec.generate(PROMPTS, [params(20 + i) for i in range(6)])
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert all(len(o.token_ids) == 24 for o in first)
    stats = spec.engine.speculative.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
