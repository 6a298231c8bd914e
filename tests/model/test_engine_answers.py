"""Distillation data from keyserve's engine (training/engine_answers.py) and training on from an
exported draft (``--init-from DIR``, training/export.py ``import_draft``), on stories260K.

The oracle for the recorded distributions is the paged serving model run teacher-forced over
each answer, as for the dense generator's records (test_draft_model.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.paged_runner import PagedRunner
from safetensors.torch import load_file

from keyserve.cli import main as cli_main
from keyserve.config import EngineConfig
from keyserve.engine.llm_engine import LLMEngine
from keyserve.model.draft_model import DRAFT_META_FILE
from keyserve.model.loader import LoadedModel, load_model
from keyserve.training.distill import DistillOptions
from keyserve.training import corpus
from keyserve.training.engine_answers import engine_answers, engine_teacher_force
from keyserve.training.export import draft_tensors, import_draft
from keyserve.training.generate import GenerationJob
from keyserve.training.records import Answer, load_parts
from keyserve.training.dense import DenseLlama

TINY = ["--gen-tokens", "16", "--vocab", "200", "--batch-tokens", "256", "--time-budget-min", "3",
        "--num-prompts", "8"]
PROMPTS = ["Once upon a time", "Tom had a dog", "The sun", "Lily saw a big", "One day"]


@pytest.fixture(scope="module")
def target(stories_path: str) -> LoadedModel:
    return load_model(stories_path, progress=False)


@pytest.fixture(scope="module")
def engine(stories_path: str) -> LLMEngine:
    return LLMEngine(EngineConfig.from_flat(model=stories_path, max_num_seqs=2, kv_cache_memory_gb=0.05))


def _job(target: LoadedModel, temps: list[float], seed: int = 0) -> GenerationJob:
    tok = target.tokenizer
    prompts = [[tok.bos_token_id] + tok.encode(t) for t in PROMPTS]
    return GenerationJob(prompts, temps, [10 + i for i in range(len(prompts))], 12, set(), top_k=8, seed=seed)


def test_engine_answers_record_the_target_distribution(target: LoadedModel, engine: LLMEngine) -> None:
    """Five prompts through two engine slots: every recorded top-k row equals the serving
    model's log-softmax at that position, greedy answers equal its greedy decoding, and each
    answer is recorded under its job index."""
    job = _job(target, [0.0, 1.0, 0.0, 1.0, 0.0])
    answers: list[Answer] = []
    made = engine_answers(engine, job, float("inf"), answers.extend)
    assert sorted(a.prompt_index for a in answers) == [10, 11, 12, 13, 14]
    assert made == sum(len(a.tokens) for a in answers) == 5 * 12
    runner = PagedRunner(target.model)
    for a in answers:
        i = a.prompt_index - 10
        assert a.prompt == job.prompts[i]
        seq = a.prompt + a.tokens
        logits = runner.teacher_forced({i: seq}, {i: len(a.prompt)})[i]
        lp = torch.log_softmax(logits[len(a.prompt) - 1 : -1], -1)
        assert a.topk_ids.shape == a.topk_logprobs.shape == (12, 8)
        torch.testing.assert_close(a.topk_logprobs.float(), lp.topk(8).values, atol=2e-3, rtol=1e-3)
        assert (a.topk_ids[:, 0].long() == lp.argmax(-1)).all()
        if job.temperatures[i] == 0.0:
            assert a.tokens == runner.greedy(a.prompt, 12, seq_id=100 + i)
        runner.free_seq(i)


def test_sampled_engine_answers_follow_the_seed(target: LoadedModel, engine: LLMEngine) -> None:
    """Each prompt draws from its own seed: a rerun gives the same answers, another seed others."""
    runs = []
    for seed in (3, 3, 4):
        out: list[Answer] = []
        engine_answers(engine, _job(target, [1.0] * 5, seed), float("inf"), out.extend)
        runs.append({a.prompt_index: a.tokens for a in out})
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_engine_answers_past_the_deadline_record_nothing_and_leave_nothing(
    target: LoadedModel, engine: LLMEngine
) -> None:
    out: list[Answer] = []
    assert engine_answers(engine, _job(target, [0.0] * 5), 0.0, out.extend) == 0
    assert out == [] and not engine.has_unfinished_requests()


def test_engine_teacher_forcing_equals_the_dense_forward(target: LoadedModel, engine: LLMEngine) -> None:
    """Passages of different lengths through the engine's prefill (``prompt_logprobs``): each
    passage position's top-k equals ``corpus.teacher_force`` over the dense model, the
    independent causal forward the dense generator's corpus data comes from."""
    tok = target.tokenizer
    texts = ["Once upon a time there was a little dog.", "Tom had a big red ball and he liked it a lot.",
             "The sun", "Lily saw a big tree in the park, and she ran to it with her mom."]
    items = [(-1 - i, [tok.bos_token_id, *tok.encode("Hi.")], tok.encode(t)) for i, t in enumerate(texts)]
    got = {a.prompt_index: a for a in engine_teacher_force(engine, items, 8)}
    want = corpus.teacher_force(DenseLlama.from_serving(target.model), items, top_k=8)
    assert sorted(got) == [-4, -3, -2, -1] and not engine.has_unfinished_requests()
    for w in want:
        g = got[w.prompt_index]
        assert (g.prompt, g.tokens) == (w.prompt, w.tokens)
        assert g.topk_ids.shape == (len(w.tokens), 8)
        torch.testing.assert_close(g.topk_logprobs.float(), w.topk_logprobs.float(), atol=3e-3, rtol=1e-3)
        assert torch.equal(g.topk_ids[:, 0], w.topk_ids[:, 0])


def test_the_engine_records_at_most_twenty_alternatives(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--teacher-top-k 20"):
        DistillOptions(out=str(tmp_path), generator="engine")  # default top-k 32
    DistillOptions(out=str(tmp_path), generator="engine", teacher_top_k=20)


def test_an_exported_draft_reads_back_as_its_training_weights(stories_path: str, tmp_path: Path) -> None:
    """``import_draft`` inverts the export: every trainable tensor of the run's checkpoint, fused
    q/k/v and gate/up included, comes back under its training name (at the export's float16)."""
    run = tmp_path / "run"
    assert cli_main(["distill-draft", "--target", stories_path, "--out", str(run), *TINY, "--steps", "4"]) == 0
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    back = import_draft(run)
    assert back["identity"]["layers"] == ckpt["identity"]["layers"]
    assert back["identity"]["head_ids"] == ckpt["identity"]["head_ids"]
    kept = ckpt["best"]["weights"] or ckpt["weights"]
    assert set(back["best"]["weights"]) == set(kept)
    for name, tensor in kept.items():
        assert torch.equal(back["best"]["weights"][name], tensor.half().float()), name


def test_distill_with_the_engine_from_an_exported_draft(stories_path: str, tmp_path: Path) -> None:
    """``--generator engine`` answers every prompt (records of ``--teacher-top-k`` alternatives);
    ``--init-from DIR`` of an exported draft starts from its weights: one step at lr 1e-9 exports
    them unchanged."""
    first = tmp_path / "first"
    assert cli_main(["distill-draft", "--target", stories_path, "--out", str(first), *TINY, "--steps", "6"]) == 0
    second = tmp_path / "second"
    assert cli_main(["distill-draft", "--target", stories_path, "--out", str(second), *TINY, "--steps", "1",
                     "--lr", "1e-9", "--generator", "engine", "--gen-dtype", "float32", "--teacher-top-k", "8",
                     "--init-from", str(first), "--corpus-tokens", "300", "--time-budget-min", "15"]) == 0
    data = load_parts(second / "data")
    indices = data.prompt_index.tolist()
    assert sorted(i for i in indices if i >= 0) == list(range(8))
    passages = [data.answer(j) for j, i in enumerate(indices) if i < 0]  # the engine's teacher-forced text
    assert sum(len(a.tokens) for a in passages) >= 300
    assert data.topk_ids.shape[1] == 8
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(b[name].float(), a[name].float(), atol=1e-3, rtol=0), name
    record = json.loads((second / DRAFT_META_FILE).read_text())["training"]
    assert record["options"]["generator"] == "engine" and record["options"]["init_from"] == str(first)


def test_import_draft_fuses_in_the_export_order(target: LoadedModel, tmp_path: Path) -> None:
    """A dense draft's tensors, split by ``draft_tensors`` and fused by ``import_draft``, equal the
    originals: q, k, v and gate, up go back in the order they were cut."""
    from keyserve.model.draft_model import DraftMeta, embedding_checksum, tokenizer_fingerprint
    from keyserve.training.export import export_draft

    head = torch.arange(40)
    dense = DenseLlama.from_serving(target.model, [0, 1], head, trainable=True)
    with torch.no_grad():
        for p in dense.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    c = target.config
    meta = DraftMeta(target="t", target_vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                     tokenizer_sha256=tokenizer_fingerprint(target.tokenizer), shared_embeddings=True,
                     lm_head_token_ids=head.tolist(),
                     embedding_checksum=embedding_checksum(target.model.model.embed_tokens.weight),
                     training={"init_layers": [0, 1]})
    export_draft(dense, meta, tmp_path, dtype=torch.float32)
    back = import_draft(tmp_path)["best"]["weights"]
    for name, p in dense.named_parameters():
        if p.requires_grad:
            assert torch.equal(back[name], p.detach()), name
    assert set(draft_tensors(dense, torch.float32))  # the names the export wrote


def test_one_engine_answers_every_round_and_the_text(
    stories_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine (its weights and KV cache) is built once per run, not once per answer round
    and again for the teacher-forced text."""
    from keyserve.training import distill

    built: list[LLMEngine] = []

    class Counted(LLMEngine):
        def __init__(self, config: EngineConfig) -> None:
            super().__init__(config)
            built.append(self)

    monkeypatch.setattr(distill, "LLMEngine", Counted)
    assert cli_main(["distill-draft", "--target", stories_path, "--out", str(tmp_path), *TINY, "--steps", "1",
                     "--generator", "engine", "--gen-dtype", "float32", "--teacher-top-k", "8",
                     "--answer-rounds", "2", "--corpus-tokens", "300", "--time-budget-min", "15"]) == 0
    data = load_parts(tmp_path / "data")
    indices = data.prompt_index.tolist()
    assert sorted(i for i in indices if i >= 0) == list(range(16)) and min(indices) < 0
    assert len(built) == 1
