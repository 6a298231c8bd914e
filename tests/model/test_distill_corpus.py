"""Teacher-forced distillation data (training/corpus.py): every recorded top-k row is the
serving model's own distribution along the text, and ``distill-draft --corpus-tokens`` adds
such passages to the data, resumably, without putting them in the held-out set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.paged_runner import PagedRunner

from keyserve.cli import main as cli_main
from keyserve.model.loader import LoadedModel, load_model
from keyserve.training import corpus
from keyserve.training.dense import DenseLlama
from keyserve.training.distill import _split
from keyserve.training.records import load_parts


@pytest.fixture(scope="module")
def target(stories_path: str) -> LoadedModel:
    return load_model(stories_path, progress=False)


def test_passages_mix_every_source_and_are_deterministic() -> None:
    a, b = corpus.passages(seed=3)[:30], corpus.passages(seed=3)[:30]
    assert a == b and len(set(a)) == 30
    assert all(corpus.MIN_PASSAGE_CHARS <= len(p.strip()) and len(p) <= 1200 for p in a)
    first_round = corpus.passages(seed=3)[: len(corpus.SOURCES)]
    assert len(first_round) == len(corpus.SOURCES)  # one passage of each source before any second


def test_teacher_force_records_the_serving_distribution(target: LoadedModel) -> None:
    """Items of different lengths share padded batches; each passage position's top-k equals
    the paged serving model's log-softmax there (an independent forward)."""
    tok = target.tokenizer
    texts = ["Once upon a time there was a little dog.", "Tom had a big red ball and he liked it a lot.",
             "The sun", "Lily saw a big tree in the park, and she ran to it with her mom."]
    items = [(-1 - i, [tok.bos_token_id], tok.encode(t)) for i, t in enumerate(texts)]
    answers = corpus.teacher_force(DenseLlama.from_serving(target.model), items, top_k=8, batch_tokens=40)
    assert sorted(a.prompt_index for a in answers) == [-4, -3, -2, -1]
    runner = PagedRunner(target.model)
    for a in answers:
        seq = a.prompt + a.tokens
        logits = runner.teacher_forced({0: seq}, {0: len(a.prompt)})[0]
        lp = torch.log_softmax(logits[len(a.prompt) - 1 : -1], -1)
        assert a.topk_ids.shape == (len(a.tokens), 8)
        torch.testing.assert_close(a.topk_logprobs.float(), lp.topk(8).values, atol=2e-3, rtol=1e-3)
        assert (a.topk_ids[:, 0].long() == lp.argmax(-1)).all()
        runner.free_seq(0)


def test_distill_with_corpus_tokens(stories_path: str, tmp_path: Path) -> None:
    args = ["distill-draft", "--target", stories_path, "--out", str(tmp_path), "--gen-tokens", "16",
            "--vocab", "200", "--batch-tokens", "256", "--num-prompts", "6", "--steps", "4",
            "--time-budget-min", "3", "--corpus-tokens", "600"]
    assert cli_main(args) == 0
    data = load_parts(tmp_path / "data")
    index = data.prompt_index.tolist()
    text_tokens = sum(int(data.gen_offsets[j + 1] - data.gen_offsets[j]) for j, i in enumerate(index) if i < 0)
    assert sum(i >= 0 for i in index) == 6 and text_tokens >= 600
    record = json.loads((tmp_path / "keyserve_draft.json").read_text())["training"]["data"]
    assert record["teacher_forced_tokens"] == text_tokens
    assert record["answer_tokens"] + text_tokens == data.num_tokens
    _, heldout = _split(data, 0)
    assert heldout and all(index[j] >= 0 for j in heldout)  # agreement is measured on answers only
