"""``SamplingParams.prompt_logprobs``: every prompt token's log-probability given the tokens
before it (None for the first), and its N most likely alternatives -- what lm-eval's
loglikelihood requests read through completions' ``echo`` with ``logprobs``. The oracle is Hugging
Face transformers on the same weights, one forward over the prompt: its log-softmax at every
prompt position equals what the engine reports, whether the prompt runs in one chunk or many
(the row at a chunk's end predicts the next chunk's first token), several passes of the LM head,
after a preemption (the chunks computed again keep the first values), under a KV budget, beside
speculative steps, with n > 1, and when the prompt's head is in the prefix cache (such a request
takes no cached prefix: a hit would leave its rows uncomputed).

Mutations each of these catches: the chunk-end row predicting the chunk's own last token
(``prompt_logprob_targets``); rows counted to the prompt's last token (``prompt_logprob_rows``
without the - 1: one value too many); cached prefixes still taken (positions missing: the merge
raises); the merge appending a recomputed chunk again (too many values)."""

from __future__ import annotations

import random

import pytest
import torch

from keyserve import LLM, SamplingParams
from keyserve.engine import prompt_logprobs as model_side

WORDS = "once upon a time there was a little girl named lily she loved to play outside in the park".split()
N = 3


@pytest.fixture(scope="module")
def hf(stories_hf):
    return stories_hf


def _prompts(count: int, seed: int, lo: int = 8, hi: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(count)]


def _check(hf, out, top_n: int = N) -> None:
    ids = out.prompt_token_ids
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [P, vocab]
    want = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), want, atol=1e-4, rtol=0)
    ranks = (logp[:-1] > want[:, None]).sum(-1) + 1  # 1: the model's likeliest token
    got_ranks = torch.tensor(out.prompt_logprob_ranks[1:])
    others = (logp[:-1] - want[:, None]).abs()
    others[torch.arange(len(want)), torch.tensor(ids[1:])] = float("inf")
    clear = others.min(-1).values > 1e-4  # no other token within 1e-4 of it: its rank is sure
    assert out.prompt_logprob_ranks[0] is None and (got_ranks[clear] == ranks[clear]).all()
    if not top_n:
        assert out.prompt_top_logprobs is None
        return
    tops = out.prompt_top_logprobs
    assert tops is not None and len(tops) == len(ids) and tops[0] is None
    values = logp[:-1].topk(top_n, dim=-1).values
    got = torch.tensor([[v for _, v in top] for top in tops[1:]])
    torch.testing.assert_close(got, values, atol=1e-4, rtol=0)


def _params(i: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=6 + i % 5, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True,
                          prompt_logprobs=N, **kw)


@pytest.mark.parametrize("setup", ["one_chunk", "chunks", "n2_speculative", "budget"])
def test_prompt_logprobs_equal_the_models(stories_path: str, draft_dir: str, hf, setup: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    opts: dict = dict(num_blocks=256)
    kw: dict = {}
    if setup == "chunks":  # 8-token chunks; the LM head 3 rows per pass
        opts["max_num_batched_tokens"] = 8
        monkeypatch.setattr(model_side, "ROWS_PER_PASS", 3)
    if setup == "n2_speculative":
        opts.update(draft=draft_dir, num_speculative_tokens=3)
        kw = dict(n=2, speculative=True)
    if setup == "budget":  # in 16-token chunks: eviction waits for the prompt's end
        kw = dict(kv_policy="h2o", kv_budget=0.5)
        opts["max_num_batched_tokens"] = 16
    llm = LLM(stories_path, **opts)
    prompts = _prompts(6, seed=1)
    outs = llm.generate(prompts, [_params(i, **kw) for i in range(6)])
    for out in outs:
        _check(hf, out)
    if setup == "n2_speculative":
        assert all(len(o.outputs) == 2 for o in outs) and any(o.stats.spec_draft_tokens for o in outs)
    if setup == "budget":
        assert any(o.stats.kv_tokens_evicted for o in outs)


def test_no_alternatives_with_zero_and_nothing_without_asking(stories_path: str, hf) -> None:
    """In one step: 0 alternatives, none asked, and 1 and 4 beside each other (each row trims
    the step's one top-k to its own count)."""
    llm = LLM(stories_path, num_blocks=128)
    [zero, plain, one, four] = llm.generate(["the dog ran to the park and"] * 2 + ["lily and ben", "once upon a time"], [
        SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0),
        SamplingParams(max_tokens=4, temperature=0.0),
        SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1),
        SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=4),
    ])
    _check(hf, zero, top_n=0)
    _check(hf, one, top_n=1)
    _check(hf, four, top_n=4)
    assert plain.prompt_logprobs is None and plain.prompt_top_logprobs is None
    assert zero.token_ids == plain.token_ids


def test_a_cached_prefix_is_not_taken(stories_path: str, hf) -> None:
    """The prompt's head is in the prefix cache: a request without prompt_logprobs takes it,
    one with them computes every row (and gets a value at every position)."""
    llm = LLM(stories_path, num_blocks=128, block_size=8)
    prompt = _prompts(1, seed=3, lo=40, hi=40)[0]
    llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0))
    [hit] = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0))
    assert hit.stats.prefix_cache_hit_tokens > 0
    [asks] = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=N))
    assert asks.stats.prefix_cache_hit_tokens == 0
    _check(hf, asks)
    assert asks.token_ids == hit.token_ids


def test_preempted_requests_keep_whole_prompt_logprobs(stories_path: str, hf) -> None:
    """A pool too small for every request at once: preempted requests recompute their prompts
    (the chunks' values again) and still report each position once, equal to the model's."""
    llm = LLM(stories_path, num_blocks=40, block_size=8, max_num_batched_tokens=24)
    prompts = _prompts(10, seed=7, lo=30, hi=60)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                 prompt_logprobs=N) for _ in prompts])
    assert any(o.stats.num_preemptions for o in outs)
    for out in outs:
        _check(hf, out)


def test_a_neighbour_asking_changes_nothing_for_the_others(stories_path: str) -> None:
    prompts = _prompts(6, seed=11)
    params = [_params(i) for i in range(6)]
    alone = LLM(stories_path, num_blocks=256).generate(prompts, [p.model_copy(update={"prompt_logprobs": None})
                                                                  for p in params])
    mixed = LLM(stories_path, num_blocks=256).generate(
        prompts, [p if i % 2 else p.model_copy(update={"prompt_logprobs": None}) for i, p in enumerate(params)])
    for a, b in zip(alone, mixed, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.outputs[0].logprobs or []), torch.tensor(b.outputs[0].logprobs or []))


@pytest.mark.parametrize("bad", [-1, 21, 2.5, True])
def test_bad_values_are_refused(stories_path: str, bad: object) -> None:
    llm = LLM(stories_path, num_blocks=32)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate("once upon a time", SamplingParams.model_construct(
            **{**SamplingParams().model_dump(), "prompt_logprobs": bad}))
