"""A step that ran but whose tokens never reached the engine (in the Ray engine: an actor died
after the shards sampled, and the compiled graph was torn down before the driver read the
result) is scheduled again. Seeded requests must still emit exactly what they emit without the
fault: the generators rewind to the mark of the sequence's token count
(``core.generator_marks``). Here the fault is injected in-process: the model side runs every
step twice and the engine keeps only the second run, the same for the draft's proposals."""

from __future__ import annotations

import pytest
import torch

from keyserve import LLM, SamplingParams
from keyserve.core.generator_marks import GeneratorMarks

PROMPTS = ["once upon a time there was a little girl", "the dog ran to the park and", "lily and ben"]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True, speculative=False),
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=4, ignore_eos=True),  # verified drafts
        SamplingParams(max_tokens=16, temperature=1.0, seed=5, n=2, ignore_eos=True),  # forked siblings
    ]


def _tokens(llm: LLM) -> list[list[list[int]]]:
    return [[o.token_ids for o in out.outputs] for out in llm.generate(PROMPTS, _params())]


def _run_twice(obj: object, name: str) -> None:
    """``obj.name`` runs twice per call; the first result is dropped (the lost step)."""
    real = getattr(obj, name)

    def twice(*args, **kwargs):
        real(*args, **kwargs)
        return real(*args, **kwargs)

    setattr(obj, name, twice)


@pytest.fixture(scope="module")
def expected(stories_path: str, draft_dir: str) -> list[list[list[int]]]:
    return _tokens(LLM(stories_path, num_blocks=200, draft=draft_dir, num_speculative_tokens=3))


def test_target_step_run_twice_emits_the_same_tokens(stories_path: str, draft_dir: str, expected) -> None:
    llm = LLM(stories_path, num_blocks=200, draft=draft_dir, num_speculative_tokens=3)
    _run_twice(llm.engine.runner, "execute")
    assert _tokens(llm) == expected
    assert llm.engine.speculative.stats.num_draft_tokens > 0
    assert len(llm.engine.runner.generator_marks) == 0  # dropped with the finished sequences


def test_draft_proposal_made_twice_drafts_the_same(stories_path: str, draft_dir: str, expected, caplog) -> None:
    llm = LLM(stories_path, num_blocks=200, draft=draft_dir, num_speculative_tokens=3)
    _run_twice(llm.engine.drafter, "propose")
    assert _tokens(llm) == expected
    assert "drafting failed" not in caplog.text  # the second proposal ran, not the error path
    stats = llm.engine.speculative.stats
    # the same drafts were verified, so the same number were accepted as without the fault
    ref = LLM(stories_path, num_blocks=200, draft=draft_dir, num_speculative_tokens=3)
    _tokens(ref)
    want_stats = ref.engine.speculative.stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (want_stats.num_draft_tokens,
                                                                   want_stats.num_accepted_tokens)


def test_marks_rewind_only_at_the_same_token_count() -> None:
    marks, gen = GeneratorMarks(), torch.Generator().manual_seed(1)
    marks.before_draws(7, gen, 0)
    first = torch.rand(3, generator=gen)
    marks.before_draws(7, gen, 0)  # the same step again: the same draws
    assert torch.equal(torch.rand(3, generator=gen), first)
    marks.before_draws(7, gen, 1)  # the next token: fresh draws, continuing the stream
    second = torch.rand(3, generator=gen)
    assert not torch.equal(second, first)
    marks.before_draws(7, gen, 1)
    assert torch.equal(torch.rand(3, generator=gen), second)
    marks.before_draws(8, None, 0)  # unseeded: nothing to mark
    assert len(marks) == 1
    marks.drop(7)
    assert len(marks) == 0
