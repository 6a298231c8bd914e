"""``SamplingParams.top_logprobs``: each generated token's most likely alternatives under the
model's own (raw) distribution at that position. The oracle is Hugging Face transformers on the
same weights, teacher-forced on the generated sequence: its log-softmax top-k at every position
equals what the engine reports -- on plain decode steps, multi-step rounds, n > 1 samples, and
speculative steps (the alternatives of a verified run's tokens come from the target's rows, never
the draft's)."""

from __future__ import annotations

import pytest
import torch

from keyserve import LLM, SamplingParams

PROMPTS = ["Once upon a time there was a little girl", "The dog ran to the park and"]
K = 5


@pytest.fixture(scope="module")
def hf(stories_hf):
    return stories_hf


def _oracle(hf, prompt_ids: list[int], output_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's top-K (values, ids) at each generated position: [len(output_ids), K] each."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).topk(K, dim=-1)


def _check(hf, outputs) -> int:
    checked = 0
    for out in outputs:
        for sample in out.outputs:
            values, ids = _oracle(hf, out.prompt_token_ids, sample.token_ids)
            assert sample.top_logprobs is not None and len(sample.top_logprobs) == len(sample.token_ids)
            for pos, (top, lp) in enumerate(zip(sample.top_logprobs, sample.logprobs)):
                got_ids = [t for t, _ in top]
                got_values = torch.tensor([v for _, v in top])
                torch.testing.assert_close(got_values, values[pos], atol=1e-4, rtol=0)
                gaps = (values[pos][:-1] - values[pos][1:]).abs()
                if bool((gaps > 1e-4).all()):  # no near-tie: the order is the model's
                    assert got_ids == ids[pos].tolist()
                token = sample.token_ids[pos]
                if token in got_ids:  # the chosen token's entry is its own logprob
                    assert top[got_ids.index(token)][1] == pytest.approx(lp, abs=1e-5)
                checked += 1
    return checked


@pytest.mark.parametrize("steps", [1, 4])
def test_alternatives_equal_the_models_distribution(stories_path: str, hf, steps: int) -> None:
    llm = LLM(stories_path, num_blocks=128, num_scheduler_steps=steps)
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=True, top_logprobs=K, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, seed=3, n=2, logprobs=True, top_logprobs=K,
                       ignore_eos=True),
    ]
    assert _check(hf, llm.generate(PROMPTS, params)) == 12 * 3
    if steps > 1:
        assert llm.engine.num_steps < 12  # the alternatives came through multi-step rounds


def test_speculative_steps_report_the_targets_alternatives(stories_path: str, draft_dir: str, hf) -> None:
    llm = LLM(stories_path, num_blocks=128, draft=draft_dir, num_speculative_tokens=3)
    params = [SamplingParams(max_tokens=16, temperature=t, seed=5, logprobs=True, top_logprobs=K, ignore_eos=True)
              for t in (0.0, 0.8)]
    assert _check(hf, llm.generate(PROMPTS, params)) == 32
    stats = llm.engine.speculative.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0  # verified runs were reported


def test_no_alternatives_unless_asked(stories_path: str) -> None:
    llm = LLM(stories_path, num_blocks=64)
    [out] = llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, logprobs=True))
    assert out.outputs[0].top_logprobs is None and len(out.outputs[0].logprobs) == 4
    with pytest.raises(ValueError):
        SamplingParams(top_logprobs=21)
