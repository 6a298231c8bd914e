"""Draft models: ``keyserve distill-draft`` end to end on stories260K, the draft loader
(shared embeddings reattached, full-vocabulary logits that are -inf outside the pruned head,
clear errors on mismatched targets), resuming, and the committed SmolLM2 draft (slow)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.paged_runner import PagedRunner
from safetensors import safe_open

from keyserve.cli import main as cli_main
from keyserve.model.draft_model import (
    DRAFT_META_FILE,
    DraftError,
    DraftMeta,
    PrunedHeadLlama,
    default_draft_dir,
    load_draft,
    tokenizer_fingerprint,
)
from keyserve.model.llama import LlamaForCausalLM
from keyserve.model.loader import LoadedModel, load_model, load_vocab
from keyserve.training.acceptance import calibration, simulate_confident, simulate_greedy, simulate_tree, tree_nodes
from keyserve.training.dense import DenseLlama
from keyserve.training.distill import DistillOptions, _split, distill_draft, init_layer_ids
from keyserve.training.export import export_draft
from keyserve.training.generate import GenerationJob, generate_answers
from keyserve.training.records import Answer, TeacherData, load_parts
from keyserve.training.teacher_forced import teacher_forced_logits

TINY = ["--gen-tokens", "24", "--vocab", "200", "--batch-tokens", "256",
        "--time-budget-min", "3"]


def _distill(target: str, out: Path, *extra: str) -> None:
    if "--num-prompts" not in extra:
        extra = (*extra, "--num-prompts", "10")
    assert cli_main(["distill-draft", "--target", target, "--out", str(out), *TINY, *extra]) == 0


def _meta(path: Path) -> dict:
    return json.loads((path / DRAFT_META_FILE).read_text())


@pytest.fixture(scope="module")
def target(stories_path: str) -> LoadedModel:
    return load_model(stories_path, progress=False)


@pytest.fixture(scope="module")
def distilled(stories_path: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("draft")
    _distill(stories_path, out, "--steps", "20")
    return out


def test_distill_end_to_end_loss_decreases(distilled: Path, target: LoadedModel) -> None:
    meta = _meta(distilled)
    training = meta["training"]
    assert training["steps"] == 20
    assert training["heldout_final"]["kl"] < training["heldout_initial"]["kl"]
    assert training["loss_last"] < training["loss_first"]
    assert training["data"]["answer_tokens"] > 0
    assert training["command"].startswith("keyserve distill-draft")
    assert len(meta["lm_head_token_ids"]) == 200
    assert {target.tokenizer.eos_token_id, target.tokenizer.bos_token_id} <= set(meta["lm_head_token_ids"])
    assert (distilled / ".gitignore").read_text().startswith("checkpoint.pt")
    draft = load_draft(str(distilled), target)
    assert isinstance(draft.model, PrunedHeadLlama)
    assert draft.config.num_hidden_layers == 2 and draft.config.vocab_size == target.config.vocab_size
    assert draft.tokenizer is target.tokenizer


def test_shared_embeddings_are_reattached_not_stored(distilled: Path, target: LoadedModel) -> None:
    with safe_open(str(distilled / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" not in names and "lm_head.weight" in names
    draft = load_draft(str(distilled), target).model
    shared = draft.model.embed_tokens.weight
    assert shared.data_ptr() == target.model.model.embed_tokens.weight.data_ptr()
    assert all(p.data_ptr() != shared.data_ptr() for p in draft.parameters())
    # A different dtype gets a converted copy of the same values.
    bf16 = load_draft(str(distilled), target, dtype=torch.bfloat16).model
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.model.embed_tokens.weight.float(), shared, atol=1e-2, rtol=1e-2)


def test_full_vocab_logits_are_minus_inf_outside_the_head(distilled: Path, target: LoadedModel) -> None:
    draft = load_draft(str(distilled), target).model
    logits = PagedRunner(draft).teacher_forced({0: list(range(3, 40))}, {0: 12})[0]
    assert logits.shape == (37, target.config.vocab_size)
    head = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    head[draft.head_token_ids] = True
    assert torch.isneginf(logits[:, ~head]).all()
    assert torch.isfinite(logits[:, head]).all()
    probs = torch.softmax(logits, -1)
    assert (probs[:, ~head] == 0).all() and torch.allclose(probs.sum(-1), torch.ones(37))


def test_acceptance_tool_logits_equal_the_paged_runner(distilled: Path, target: LoadedModel) -> None:
    """The acceptance tool's engine-free logits (dense forward, serving LM head) equal the paged
    model's at every position, for a pruned-head draft (-inf outside the head) and a target."""
    draft = load_draft(str(distilled), target).model
    toks = list(range(3, 40))
    for model in (draft, target.model):
        ours = teacher_forced_logits(model, toks)
        ref = PagedRunner(model).teacher_forced({0: toks}, {0: 7})[0]
        finite = torch.isfinite(ref)
        assert ours.shape == ref.shape and torch.equal(torch.isfinite(ours), finite)
        torch.testing.assert_close(ours[finite], ref[finite], atol=1e-4, rtol=1e-4)


def test_simulated_greedy_speculation_counts_tokens_per_forward() -> None:
    # agree = draft argmax == target token at each position of the target's text.
    # K = 2 over [T, T, T, F, T]: accept 2 (+1 target token) -> pos 3; reject at 3 (+1) -> pos 4;
    # accept 1 (+1) -> pos 6 >= 5: three forwards for five tokens.
    assert simulate_greedy([True, True, True, False, True], 2) == pytest.approx(5 / 3)
    assert simulate_greedy([False] * 4, 3) == 1.0  # every forward yields only its own token
    assert simulate_greedy([True] * 6, 5) == 6.0  # one forward: five drafts and the bonus


def test_simulated_confident_chains_stop_where_the_draft_doubts() -> None:
    agree = [True, True, True, False, True, True]
    peaks = [0.9, 0.8, 0.2, 0.9, 0.9, 0.1]
    # threshold 0: the plain chain (K = 3: accept positions 0-2, the target's own token at 3
    # -> pos 4; accept 4 and 5 -> done): 2 forwards, 3 + 2 drafts
    assert simulate_confident(agree, peaks, 3, 0.0) == (pytest.approx(5 / 2), pytest.approx(6 / 2))
    assert simulate_confident(agree, peaks, 3, 0.0)[1] == pytest.approx(simulate_greedy(agree, 3))
    # threshold 0.5: the chain stops before position 2 (peak 0.2): 2 drafts + 1 -> pos 3;
    # position 3 is drafted and rejected (+1) -> pos 4; positions 4 drafted and accepted, 5
    # doubted: 1 draft + 1 -> pos 6. Three forwards, 2 + 1 + 1 drafts.
    assert simulate_confident(agree, peaks, 3, 0.5) == (pytest.approx(4 / 3), pytest.approx(6 / 3))
    assert simulate_confident(agree, peaks, 3, 1.0) == (0.0, 1.0)  # never sure: one token per forward


def test_calibration_bins_the_draft_peaks() -> None:
    bins = calibration([True, False, True, True], [0.1, 0.3, 0.35, 1.0])
    assert bins["0.0-0.2"] == (0.25, 1.0)
    assert bins["0.2-0.4"] == (0.5, 0.5)
    assert bins["0.9-1.0"] == (0.25, 1.0)  # a peak of exactly 1 lands in the last bin
    assert bins["0.4-0.6"] == (0.0, 0.0)
    assert sum(share for share, _ in bins.values()) == pytest.approx(1.0)


def test_simulated_tree_counts_tokens_per_forward() -> None:
    # ranks of the target's token in the draft (0: its argmax). Tree 2x1 over [1, 0, 3, 0, 0]:
    # depth 0 takes rank < 2 (1: yes), depth 1 rank < 1 (0: yes) -> 2 drafts + 1, pos 3;
    # then rank 0 < 2, rank 0 < 1 -> pos 6 >= 5: 2 forwards for 5 tokens. A chain (1x1) of the
    # same text: rejects at 0 (pos 1), accepts 1 and stops at 3 (pos 3), accepts 2 (done): 3.
    ranks = [1, 0, 3, 0, 0]
    assert simulate_tree(ranks, (2, 1)) == pytest.approx(5 / 2)
    assert simulate_tree(ranks, (1, 1)) == pytest.approx(5 / 3)
    assert simulate_tree([5, 5], (4,)) == 1.0  # never among the top 4: one token per forward
    assert simulate_tree([3, 0, 0], (4, 1, 1)) == 3.0  # one forward: three drafts
    assert (tree_nodes((2, 1)), tree_nodes((3, 2, 1)), tree_nodes((1, 1, 1))) == (4, 15, 3)


def test_exported_draft_equals_the_trained_model(
    distilled: Path, target: LoadedModel, tmp_path: Path
) -> None:
    """Export at float32 and compare the serving model's paged logits with the dense
    training model's on the same weights: the q/k/v, gate/up split and head rows line up."""
    ckpt = torch.load(distilled / "checkpoint.pt", weights_only=True)
    ids = torch.tensor(ckpt["identity"]["head_ids"])
    dense = DenseLlama.from_serving(target.model, ckpt["identity"]["layers"], ids, trainable=True)
    with torch.no_grad():
        for name, p in dense.named_parameters():
            if name in ckpt["weights"]:
                p.copy_(ckpt["weights"][name])
    meta = DraftMeta.read(distilled / DRAFT_META_FILE)
    export_draft(dense, meta, tmp_path, dtype=torch.float32)
    served = load_draft(str(tmp_path), target).model
    toks = list(range(5, 45))
    paged = PagedRunner(served).teacher_forced({0: toks}, {0: 9})[0]
    with torch.no_grad():
        ref = dense.logits(dense(torch.tensor([toks]), torch.arange(len(toks))[None]))[0]
    torch.testing.assert_close(paged[:, ids], ref, atol=1e-4, rtol=1e-4)


def test_resume_continues_from_the_checkpoint(stories_path: str, tmp_path: Path) -> None:
    _distill(stories_path, tmp_path, "--steps", "6")
    first = _meta(tmp_path)["training"]
    parts = sorted((tmp_path / "data").glob("part-*"))
    with pytest.raises(ValueError, match="--resume"):  # refuses to overwrite without --resume
        distill_draft(DistillOptions(out=str(tmp_path), target=stories_path))
    _distill(stories_path, tmp_path, "--steps", "12", "--resume")
    second = _meta(tmp_path)["training"]
    assert sorted((tmp_path / "data").glob("part-*")) == parts  # no data regenerated
    assert second["steps"] == 12 and first["steps"] == 6
    assert second["loss_first"] == first["loss_first"]  # the same run, continued
    assert second["heldout_initial"] == first["heldout_initial"]
    assert second["train_tokens"] > first["train_tokens"]


def test_plain_hf_directory_drafts_for_itself(stories_path: str, target: LoadedModel) -> None:
    draft = load_draft(stories_path, target)
    assert type(draft.model) is LlamaForCausalLM and draft.tokenizer is target.tokenizer
    toks = {0: list(range(3, 30))}
    ours = PagedRunner(draft.model).teacher_forced(toks, {0: 5})[0]
    ref = PagedRunner(target.model).teacher_forced(toks, {0: 5})[0]
    torch.testing.assert_close(ours, ref)


def test_mismatched_targets_are_refused(distilled: Path, target: LoadedModel, tmp_path: Path) -> None:
    other_vocab = dataclasses.replace(target, config=dataclasses.replace(target.config, vocab_size=1024))
    with pytest.raises(DraftError, match="vocab"):
        load_draft(str(distilled), other_vocab)
    copy = tmp_path / "draft"
    shutil.copytree(distilled, copy, ignore=shutil.ignore_patterns("data", "checkpoint.pt"))
    meta = _meta(copy)
    meta["tokenizer_sha256"] = "0" * 64
    (copy / DRAFT_META_FILE).write_text(json.dumps(meta))
    with pytest.raises(DraftError, match="tokenizer"):
        load_draft(str(copy), target)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_draft(str(tmp_path / "nowhere"), target)


def test_a_plain_draft_with_another_vocabulary_file_is_refused(stories_path: str, target: LoadedModel,
                                                                tmp_path: Path) -> None:
    """A plain draft directory's own tokenizer.json is read (with the tokenizers library, not
    AutoTokenizer) and compared with the target's: two tokens' ids swapped are refused."""
    copy = tmp_path / "plain"
    shutil.copytree(stories_path, copy)
    tok = json.loads((copy / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = [t for t in vocab if t.isalpha() and len(t) > 2][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (copy / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(DraftError, match="tokenizer"):
        load_draft(str(copy), target)


def test_the_vocabulary_reader_equals_transformers(stories_path: str, target: LoadedModel) -> None:
    """``load_vocab`` (the draft actor's tokenizers-only read) gives transformers' table."""
    assert load_vocab(stories_path).get_vocab() == target.tokenizer.get_vocab()
    assert tokenizer_fingerprint(load_vocab(stories_path)) == tokenizer_fingerprint(target.tokenizer)


def test_generation_records_the_target_distribution(target: LoadedModel) -> None:
    """Slots are refilled as answers finish; every recorded top-k row equals the serving
    model's log-softmax at that position, and greedy answers equal its greedy decoding."""
    tok = target.tokenizer
    prompts = [[tok.bos_token_id] + tok.encode(t) for t in
               ["Once upon a time", "Tom had a dog", "The sun", "Lily saw a big", "One day"]]
    job = GenerationJob(prompts, [0.0, 1.0, 0.0, 1.0, 0.0], list(range(5)), 12, set(), top_k=8, slots=2)
    answers: list[Answer] = []
    generate_answers(DenseLlama.from_serving(target.model), job, float("inf"), answers.extend)
    assert sorted(a.prompt_index for a in answers) == list(range(5))
    runner = PagedRunner(target.model)
    for a in answers:
        seq = a.prompt + a.tokens
        logits = runner.teacher_forced({a.prompt_index: seq}, {a.prompt_index: len(a.prompt)})
        lp = torch.log_softmax(logits[a.prompt_index][len(a.prompt) - 1 : -1], -1)
        torch.testing.assert_close(a.topk_logprobs.float(), lp.topk(8).values, atol=2e-3, rtol=1e-3)
        assert (a.topk_ids[:, 0].long() == lp.argmax(-1)).all()
        if job.temperatures[a.prompt_index] == 0.0:
            assert a.tokens == runner.greedy(a.prompt, 12, seq_id=100 + a.prompt_index)
        runner.free_seq(a.prompt_index)


def test_init_layers_default_to_first_and_last() -> None:
    assert init_layer_ids(None, 2, 30) == [0, 29]
    assert init_layer_ids(None, 3, 30) == [0, 15, 29]
    assert init_layer_ids("3,4", 2, 30) == [3, 4]
    with pytest.raises(ValueError):
        init_layer_ids("3", 2, 30)


@pytest.mark.slow
def test_committed_smollm2_draft_loads_and_is_small() -> None:
    path = default_draft_dir()
    # The committed files (a local re-run also leaves checkpoint.pt and data/, git-ignored there).
    committed = ["config.json", "model.safetensors", DRAFT_META_FILE, "README.md"]
    size = sum((path / name).stat().st_size for name in committed)
    assert size <= 25 * 1000 * 1000, f"{path} holds {size / 1e6:.1f} MB"
    target = load_model(None, progress=False)
    draft = load_draft("default", target)
    assert isinstance(draft.model, PrunedHeadLlama) and draft.model.shares_embeddings
    prompt = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    greedy = PagedRunner(target.model).greedy(prompt, 24, stop_token_ids=[target.tokenizer.eos_token_id])
    seq = prompt + greedy
    logits = PagedRunner(draft.model).teacher_forced({0: seq}, {0: len(seq)})[0]
    agree = (logits[len(prompt) - 1 : -1].argmax(-1) == torch.tensor(greedy)).float().mean()
    # A sanity floor (an untrained draft scores ~0); README.md there records the measured rate.
    assert agree > 0.1, f"draft agrees with the target's greedy tokens only {agree:.0%} of the time"


def test_transformers_copy_of_the_draft_matches(distilled: Path, target: LoadedModel, stories_path: str) -> None:
    """The transformers model built for assisted-generation comparisons gives the same logits
    (-inf outside the head) and leaves greedy output unchanged."""
    import transformers

    from keyserve.training.hf import draft_for_transformers

    hf_target = transformers.AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32)
    hf_draft = draft_for_transformers(distilled, hf_target)
    assert hf_draft.get_input_embeddings() is hf_target.get_input_embeddings()
    toks = list(range(5, 40))
    with torch.no_grad():
        theirs = hf_draft(torch.tensor([toks])).logits[0]
    ours = PagedRunner(load_draft(str(distilled), target).model).teacher_forced({0: toks}, {0: 10})[0]
    finite = torch.isfinite(ours)
    assert torch.equal(torch.isfinite(theirs), finite)
    torch.testing.assert_close(theirs[finite], ours[finite], atol=1e-4, rtol=1e-4)
    prompt = torch.tensor([[1] + toks[:5]])
    assisted = hf_target.generate(prompt, assistant_model=hf_draft, max_new_tokens=16, do_sample=False)
    plain = hf_target.generate(prompt, max_new_tokens=16, do_sample=False)
    assert torch.equal(assisted, plain)


def test_resume_after_interrupted_generation_answers_only_missing_prompts(
    stories_path: str, tmp_path: Path
) -> None:
    """Without a checkpoint, --resume keeps the saved answers and asks the target only for the
    prompts it has not answered (here: 4 more prompts than the first run had)."""
    from keyserve.training.records import TeacherData, load_parts

    _distill(stories_path, tmp_path, "--steps", "2")
    (tmp_path / "checkpoint.pt").unlink()  # as if stopped before training
    before = load_parts(tmp_path / "data")
    assert before is not None and sorted(before.prompt_index.tolist()) == list(range(10))
    parts = sorted((tmp_path / "data").glob("part-*"))
    tail = TeacherData.load(parts[-1])
    _distill(stories_path, tmp_path, "--steps", "2", "--resume", "--num-prompts", "14")
    after = load_parts(tmp_path / "data")
    assert after is not None and sorted(after.prompt_index.tolist()) == list(range(14))
    assert torch.equal(TeacherData.load(parts[-1]).gen_tokens, tail.gen_tokens)  # kept as saved


def test_answer_rounds_add_sampled_answers_and_init_from_starts_from_a_run(
    stories_path: str, tmp_path: Path
) -> None:
    """Round 2 answers every prompt again (sampled, recorded as index 10 + i); a run started
    with ``--init-from`` begins at the other run's best weights, not the target's layers."""
    first = tmp_path / "first"
    _distill(stories_path, first, "--steps", "6", "--greedy-fraction", "1.0")
    before = load_parts(first / "data")
    assert sorted(before.prompt_index.tolist()) == list(range(10))
    second = tmp_path / "second"
    second.mkdir()
    shutil.copytree(first / "data", second / "data")
    _distill(stories_path, second, "--steps", "1", "--lr", "1e-9", "--resume", "--answer-rounds", "2",
             "--greedy-fraction", "1.0", "--init-from", str(first / "checkpoint.pt"))
    after = load_parts(second / "data")
    assert sorted(after.prompt_index.tolist()) == list(range(20))
    answers = {a.prompt_index: a.tokens for a in map(after.answer, range(after.num_sequences))}
    assert any(answers[i] != answers[10 + i] for i in range(10))  # sampled, not the greedy repeat
    meta1, meta2 = _meta(first)["training"], _meta(second)["training"]
    # one step at lr 1e-9 from the first run's best weights: its held-out loss is where that
    # run ended, far below what training from the target's layers starts at
    assert meta2["heldout_initial"]["kl"] < meta1["heldout_initial"]["kl"] - 0.1
    assert meta2["options"]["init_from"] == str(first / "checkpoint.pt")
    _, held = _split(after, 0, 10)
    bases = {int(after.prompt_index[j]) % 10 for j in held}
    assert all((int(after.prompt_index[j]) % 10 in bases) == (j in held)
               for j in range(after.num_sequences))  # both answers of a prompt on one side


def test_keep_last_exports_the_final_step_not_the_best(stories_path: str, tmp_path: Path) -> None:
    """At lr 30 training diverges, so the best held-out evaluation is the initial one (seeds
    0-4 all; at lr 3 a diverged step agreed by chance in two of five); ``--keep last`` exports
    the final step's weights (what the checkpoint holds) and records that step."""
    _distill(stories_path, tmp_path, "--steps", "6", "--lr", "30", "--keep", "last")
    payload = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert payload["best"]["step"] == 0  # diverged: the best is where it started
    meta = _meta(tmp_path)["training"]
    assert meta["kept_step"] == meta["steps"] == 6
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        exported = f.get_tensor("model.norm.weight")
    final = payload["weights"]["norm.weight"].to(exported.dtype)
    best = payload["best"]["weights"]["norm.weight"].to(exported.dtype)
    # (diverged weights may hold NaNs: compare them as equal)
    assert torch.allclose(exported, final, rtol=0, atol=0, equal_nan=True)
    assert not torch.allclose(exported, best, rtol=0, atol=0, equal_nan=True)


def test_the_same_seed_trains_the_same_draft_whatever_ran_before(stories_path: str, tmp_path: Path) -> None:
    """Dropout draws from a generator seeded by ``--seed``, not from whatever state earlier
    work left torch's global one in (which once made a test pass or fail by test order).

    Equal up to float rounding, not bit for bit: the same run in one process exported weights
    one float16 ulp apart (<= 3.1e-5, in at most 5 of 20 tensors) in two of four tries, the
    matrix products' summation order following their buffers' alignment. Dropout drawn from
    the global generator (the seeding line removed) moves every tensor by >= 2.4e-3."""
    weights = []
    for run, noise in enumerate((1, 2)):
        torch.manual_seed(noise)  # the caller's RNG state differs between the runs
        out = tmp_path / f"run{run}"
        _distill(stories_path, out, "--steps", "4", "--seed", "7")
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            weights.append({name: f.get_tensor(name) for name in f.keys()})
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.allclose(weights[0][name], weights[1][name], rtol=0, atol=5e-4) for name in weights[0])


def test_with_data_trains_on_an_earlier_runs_data_and_never_holds_it_out(
    stories_path: str, tmp_path: Path
) -> None:
    """``--with-data DIR`` adds DIR's recorded answers to this run's (not recorded again) and
    keeps them all on the training side: the earlier run's draft trained on them, so holding
    them out would flatter an ``--init-from`` start."""
    first = tmp_path / "first"
    _distill(stories_path, first, "--steps", "2")
    earlier = load_parts(first / "data")
    second = tmp_path / "second"
    _distill(stories_path, second, "--steps", "2", "--seed", "1", "--with-data", str(first))
    own = load_parts(second / "data")
    assert own.num_sequences == 10  # only its own answers on its disk
    meta = _meta(second)["training"]
    assert meta["data"]["sequences"] == own.num_sequences + earlier.num_sequences
    assert meta["data"]["answer_tokens"] == own.num_tokens + earlier.num_tokens
    both = TeacherData.concat([own, earlier])
    train, held = _split(both, 1, None, own.num_sequences)
    assert held and all(j < own.num_sequences for j in held)
    assert sorted(train + held) == list(range(both.num_sequences))  # the earlier run's all trained on


def test_with_data_refuses_a_directory_without_data_or_another_top_k(stories_path: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds no recorded data"):
        DistillOptions(out=str(tmp_path / "a"), with_data=str(tmp_path))
    first = tmp_path / "first"
    _distill(stories_path, first, "--steps", "1", "--teacher-top-k", "4")
    with pytest.raises(ValueError, match="top-4.*--teacher-top-k must match"):
        distill_draft(DistillOptions(out=str(tmp_path / "b"), target=stories_path, num_prompts=4, gen_tokens=8,
                                     vocab=200, steps=1, teacher_top_k=5, with_data=str(first),
                                     time_budget_min=1))
    assert not (tmp_path / "b").exists()  # refused before anything was recorded


def _one_step(model: DenseLlama, batch, dtype: torch.dtype | None) -> tuple[float, dict[str, torch.Tensor]]:
    from keyserve.training.train import _train_step

    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    opt = torch.optim.SGD(list(trainable.values()), lr=1.0)  # the update is the clipped gradient
    loss = _train_step(model, opt, batch, 1.0, 1e9, dtype)
    grads = {n: before[n] - p.detach() for n, p in trainable.items()}
    with torch.no_grad():  # undo: the next call starts from the same weights
        for n, p in trainable.items():
            p.copy_(before[n])
    return loss, grads


def test_bfloat16_training_steps_follow_the_float32_gradient(target: LoadedModel) -> None:
    """``--train-dtype bfloat16`` autocasts the step's matmuls: its loss and gradient are the
    float32 step's up to bf16 rounding (a bfloat16 step that silently ran in float32 equals it
    bit for bit: the autocast disabled fails here), while the weights themselves stay float32."""
    from keyserve.training.batches import make_batch

    torch.manual_seed(0)
    job = GenerationJob([[1, 5, 9, 13], [1, 7, 2]], [1.0, 1.0], [0, 1], 12, set(), top_k=8, seed=3)
    answers: list[Answer] = []
    generate_answers(DenseLlama.from_serving(target.model), job, float("inf"), answers.extend)
    data = TeacherData.from_answers(answers, 8)
    head_ids = data.topk_ids.long().unique()  # every recorded alternative in the draft's head
    head_map = torch.full((target.config.vocab_size,), -1, dtype=torch.int64)
    head_map[head_ids] = torch.arange(head_ids.numel())
    model = DenseLlama.from_serving(target.model, [0, 4], head_ids, trainable=True)
    model.set_dropout(0.0)
    batch = make_batch(data, [0, 1], head_map)
    loss32, grad32 = _one_step(model, batch, None)
    loss16, grad16 = _one_step(model, batch, torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert loss16 != loss32 and abs(loss16 - loss32) < 2e-2 * abs(loss32)
    for name, g in grad32.items():
        error = (grad16[name] - g).norm() / g.norm().clamp_min(1e-12)
        assert 0 < error < 0.05, (name, float(error))


def test_train_dtype_is_checked_and_recorded(stories_path: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--train-dtype must be one of float32, bfloat16"):
        DistillOptions(out=str(tmp_path / "x"), train_dtype="float16")
    _distill(stories_path, tmp_path, "--steps", "8", "--train-dtype", "bfloat16")
    training = _meta(tmp_path)["training"]
    assert training["options"]["train_dtype"] == "bfloat16"
    assert "--train-dtype bfloat16" in training["command"]
    assert training["loss_last"] < training["loss_first"]


def test_argmax_loss_is_the_cross_entropy_at_the_targets_argmax() -> None:
    from keyserve.training.batches import argmax_loss

    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 3.0], [1.0, 1.0, 1.0]])  # [3 positions, 3 draft tokens]
    # the target's top-2 per position as draft indices (-1: a token the draft lacks) and their
    # log-probabilities, not in rank order (the argmax is found, not assumed first)
    idx = torch.tensor([[1, 0], [2, 1], [-1, 0]])
    lp = torch.tensor([[-2.0, -0.2], [-0.1, -3.0], [-0.3, -1.5]])
    logp = torch.log_softmax(logits, -1)
    # position 0: argmax is draft token 0; position 1: token 2; position 2's argmax is not in
    # the draft's vocabulary (left out, not replaced by its runner-up)
    want = -(logp[0, 0] + logp[1, 2]) / 2
    assert float(argmax_loss(logits, idx, lp)) == pytest.approx(float(want))
    assert float(argmax_loss(logits[2:], idx[2:], lp[2:])) == 0.0


def test_argmax_weight_adds_the_argmax_term_to_the_step(target: LoadedModel, stories_path: str,
                                                        tmp_path: Path) -> None:
    """``--argmax-weight w``: the step's loss is the KL + w x the argmax cross-entropy (its
    gradient moves with it); the option is checked and recorded."""
    from keyserve.training.batches import argmax_loss, distill_loss, make_batch
    from keyserve.training.train import _train_step

    torch.manual_seed(0)
    job = GenerationJob([[1, 5, 9, 13], [1, 7, 2]], [1.0, 1.0], [0, 1], 12, set(), top_k=8, seed=3)
    answers: list[Answer] = []
    generate_answers(DenseLlama.from_serving(target.model), job, float("inf"), answers.extend)
    data = TeacherData.from_answers(answers, 8)
    head_ids = data.topk_ids.long().unique()
    head_map = torch.full((target.config.vocab_size,), -1, dtype=torch.int64)
    head_map[head_ids] = torch.arange(head_ids.numel())
    model = DenseLlama.from_serving(target.model, [0, 4], head_ids, trainable=True)
    model.set_dropout(0.0)
    batch = make_batch(data, [0, 1], head_map)
    with torch.no_grad():
        logits = model.logits(model(batch.input_ids, batch.positions)[batch.rows, batch.cols])
        kl = float(distill_loss(logits, batch.teacher_idx, batch.teacher_lp))
        ce = float(argmax_loss(logits, batch.teacher_idx, batch.teacher_lp))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    assert _train_step(model, opt, batch, 0.0, 1e9) == pytest.approx(kl, rel=1e-5)
    assert _train_step(model, opt, batch, 0.0, 1e9, argmax_weight=0.5) == pytest.approx(kl + 0.5 * ce, rel=1e-5)
    with pytest.raises(ValueError, match="--argmax-weight must be a number >= 0"):
        DistillOptions(out=str(tmp_path / "x"), argmax_weight=-1.0)
    _distill(stories_path, tmp_path / "run", "--steps", "4", "--argmax-weight", "0.5")
    training = _meta(tmp_path / "run")["training"]
    assert training["options"]["argmax_weight"] == 0.5 and "--argmax-weight 0.5" in training["command"]
