"""Logits of our paged model equal transformers' on the same weights (docs/algorithms.md §1,
issue 2).

Every case prefills and then decodes 32 tokens one step at a time through a shuffled paged
cache, and compares the logits at every position with one full causal forward of transformers
(eager attention). float32 must agree to 1e-4.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_refs import hf_logits, ours_from_hf, tiny_hf
from helpers.paged_runner import PagedRunner

from keyserve.model.loader import load_model

TOL_FP32 = 1e-4
DECODE_STEPS = 32


def _tokens(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check_parity(
    hf: transformers.PreTrainedModel,
    runner: PagedRunner,
    prompt_lens: list[int],
    chunks: int = 1,
    tol: float = TOL_FP32,
) -> float:
    vocab = hf.config.vocab_size
    seqs = {i: _tokens(vocab, n + DECODE_STEPS, seed=100 + i) for i, n in enumerate(prompt_lens)}
    ours = runner.teacher_forced(seqs, dict(enumerate(prompt_lens)), chunks=chunks)
    worst = 0.0
    for i, toks in seqs.items():
        diff = (ours[i] - hf_logits(hf, toks)).abs().max().item()
        worst = max(worst, diff)
    assert worst <= tol, f"max |logit diff| {worst:.3g} > {tol}"
    return worst


@pytest.fixture(scope="module")
def tiny() -> transformers.PreTrainedModel:
    return tiny_hf("llama")


def test_tiny_llama3_gqa_untied_single(tiny: transformers.PreTrainedModel) -> None:
    """GQA (8 q / 2 kv heads), llama3 rope scaling (positions run past its original 64), untied."""
    model = ours_from_hf(tiny)
    assert not model.config.tie_word_embeddings and model.config.rope.rope_type == "llama3"
    _check_parity(tiny, PagedRunner(model, num_blocks=64, block_size=16), [70])


def test_tiny_batch_of_three_packed(tiny: transformers.PreTrainedModel) -> None:
    """Three sequences of different lengths share every prefill and decode step."""
    model = ours_from_hf(tiny)
    _check_parity(tiny, PagedRunner(model, num_blocks=96, block_size=4, seed=3), [41, 7, 19])


def test_chunked_prefill_equals_one_shot(tiny: transformers.PreTrainedModel) -> None:
    model = ours_from_hf(tiny)
    lens = [33, 18]
    seqs = {i: _tokens(300, n + 4, seed=7 + i) for i, n in enumerate(lens)}
    one = PagedRunner(model, num_blocks=64, block_size=8, seed=1)
    two = PagedRunner(model, num_blocks=64, block_size=8, seed=2)
    a = one.teacher_forced(seqs, dict(enumerate(lens)), chunks=1)
    b = two.teacher_forced(seqs, dict(enumerate(lens)), chunks=2)
    for i in seqs:
        torch.testing.assert_close(a[i], b[i], atol=1e-5, rtol=0)
    _check_parity(tiny, PagedRunner(model, num_blocks=64, block_size=8, seed=4), lens, chunks=2)


def test_mixed_decode_and_prefill_step(tiny: transformers.PreTrainedModel) -> None:
    """One step holding a decode token of one sequence and a prompt chunk of another."""
    model = ours_from_hf(tiny)
    runner = PagedRunner(model, num_blocks=64, block_size=4, seed=5)
    a, b = _tokens(300, 12, seed=1), _tokens(300, 9, seed=2)
    runner.step(prefill=[(0, a[:11])])
    logits = runner.step(decode=[(0, a[11])], prefill=[(1, b)])
    torch.testing.assert_close(logits[0], hf_logits(tiny, a)[11], atol=TOL_FP32, rtol=0)
    torch.testing.assert_close(logits[1:], hf_logits(tiny, b), atol=TOL_FP32, rtol=0)


def test_stories260k(stories_path: str) -> None:
    """The real tiny model (8 q / 4 kv heads, tied embeddings), batch of three."""
    loaded = load_model(stories_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        stories_path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    runner = PagedRunner(loaded.model, num_blocks=128, block_size=16, seed=11)
    _check_parity(hf, runner, [50, 3, 23])


def test_stories260k_prompt_text(stories_path: str) -> None:
    """Greedy text through the tokenizer matches the model card's sample."""
    loaded = load_model(stories_path)
    prompt = loaded.tokenizer("Once upon a time")["input_ids"]
    out = PagedRunner(loaded.model, num_blocks=32).greedy(prompt, 12)
    text = loaded.tokenizer.decode(out)
    assert text.startswith(", there was a little girl named Lily"), text


def test_mistral_sliding_window() -> None:
    """Mistral layout with a sliding window shorter than the sequence."""
    hf = tiny_hf("mistral", seed=1, sliding_window=12)
    model = ours_from_hf(hf)
    assert model.config.sliding_window == 12
    _check_parity(hf, PagedRunner(model, num_blocks=64, block_size=4), [30, 9])


def test_qwen2_biases_and_mixed_window_layers() -> None:
    """Qwen2: q/k/v biases without an o_proj bias; sliding window on the last layers only."""
    hf = tiny_hf(
        "qwen2",
        seed=2,
        use_sliding_window=True,
        sliding_window=10,
        max_window_layers=1,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = ours_from_hf(hf)
    assert model.config.qkv_bias and not model.config.o_bias
    assert model.config.sliding_layers == (False, True, True)
    _check_parity(hf, PagedRunner(model, num_blocks=64, block_size=4), [25, 6])


def test_bfloat16_close(tiny: transformers.PreTrainedModel) -> None:
    """bfloat16 runs end to end and stays close to transformers in bfloat16 and to float32."""
    ours16 = ours_from_hf(tiny, dtype=torch.bfloat16)
    assert ours16.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    hf16 = tiny_hf("llama").to(torch.bfloat16)
    toks = _tokens(300, 40 + 8, seed=21)
    ours = PagedRunner(ours16, num_blocks=32, block_size=16).teacher_forced({0: toks}, {0: 40})[0]
    ref16 = hf_logits(hf16, toks)
    ref32 = hf_logits(tiny, toks)
    scale = ref32.abs().max().item()
    assert (ours - ref16).abs().max().item() <= 0.05 * scale
    assert (ours - ref32).abs().max().item() <= 0.05 * scale
    assert (ours.argmax(-1) == ref32.argmax(-1)).float().mean() >= 0.9


@torch.no_grad()
def test_rows_keep_only_the_asked_outputs(tiny: transformers.PreTrainedModel) -> None:
    """``forward(..., rows)`` (the engine asks only for sampled rows): the hidden states of
    those rows, in their order, equal the full forward's, and every token's K/V -- the last
    layer's included -- is written exactly as without ``rows``."""
    model = ours_from_hf(tiny)
    full, part = (PagedRunner(model, num_blocks=64, block_size=8, seed=5) for _ in range(2))
    prompts = [(0, _tokens(300, 21, seed=1)), (1, _tokens(300, 9, seed=2))]
    ids, pos, meta = full.build(prefill=prompts)
    ids_b, pos_b, meta_b = part.build(prefill=prompts)
    h_full, _ = model(ids, pos, full.kv_caches, meta)
    rows = torch.tensor([29, 20, 3])  # both prompts' last tokens and one inside, out of order
    h_part, _ = model(ids_b, pos_b, part.kv_caches, meta_b, rows)
    assert h_part.shape == (3, model.config.hidden_size)
    torch.testing.assert_close(h_part, h_full.index_select(0, rows), atol=1e-5, rtol=1e-5)
    for (k_a, v_a), (k_b, v_b) in zip(full.kv_caches, part.kv_caches, strict=True):
        assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b)
