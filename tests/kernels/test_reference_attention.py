"""The pure-torch reference (the CPU path and the kernels' oracle) against dense attention."""

from __future__ import annotations

import pytest
import torch
from paged_cases import dense_decode, dense_prefill, make_case, tolerance

from keyserve.kernels.reference import (
    gumbel_from_uniform,
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
    write_kv_reference,
)


@pytest.mark.parametrize(
    "block_size,head_dim,num_kv_heads,group,dtype,window",
    [
        (16, 64, 3, 3, torch.float32, None),
        (8, 128, 2, 4, torch.bfloat16, None),
        (32, 8, 4, 2, torch.float32, 7),
        (16, 64, 1, 8, torch.float32, 20),
    ],
)
def test_decode_reference_matches_dense(block_size, head_dim, num_kv_heads, group, dtype, window):
    case = make_case([0, 1, 5, 37, 70], block_size, num_kv_heads, head_dim, dtype, seed=1)
    q = torch.randn(5, num_kv_heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    out, scores = paged_decode_attention_reference(
        q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, scale, window
    )
    assert scores is None
    torch.testing.assert_close(out, dense_decode(case, q, scale, window), **tolerance(dtype))
    assert torch.count_nonzero(out[0]) == 0  # empty context -> zeros


@pytest.mark.parametrize("window", [None, 6])
def test_prefill_reference_matches_dense(window):
    lens, q_lens = [3, 20, 10, 33], [3, 1, 10, 16]  # full prompt, decode-like, prefix + chunk
    case = make_case(lens, 8, 2, 64, seed=2)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], 6, 64)
    out, _ = paged_prefill_attention_reference(
        q, case.k_cache, case.v_cache, case.block_tables, torch.tensor(starts, dtype=torch.int32),
        case.context_lens, 0.125, window,
    )
    torch.testing.assert_close(out, dense_prefill(case, q, starts, 0.125, window), atol=1e-5, rtol=1e-5)


def test_softmax_scores_are_probability_mass():
    """H2O scores: each query head's softmax sums to 1, so a kv-head's scores sum to the group
    size per query; masked slots (window, beyond context) get nothing."""
    case = make_case([0, 9, 40], 16, 2, 64, seed=3)
    q = torch.randn(3, 8, 64)
    _, scores = paged_decode_attention_reference(
        q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125,
        sliding_window=16, score_mode="softmax",
    )
    assert scores.shape == (3, 2, 40)
    torch.testing.assert_close(scores.sum(-1), torch.tensor([[0.0, 0.0], [4.0, 4.0], [4.0, 4.0]]))
    assert torch.count_nonzero(scores[1, :, 9:]) == 0 and torch.count_nonzero(scores[2, :, :24]) == 0


def test_gumbel_scores_follow_the_formula():
    """Keyformer: softmax((x + ζ) / τ) with ζ = -log(-log U), summed over the group's heads."""
    case = make_case([12], 8, 1, 16, seed=4)
    q = torch.randn(1, 2, 16)
    u = torch.rand(1, 2, 12)
    tau = torch.tensor([1.7])
    _, scores = paged_decode_attention_reference(
        q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25,
        score_mode="gumbel", tau=tau, uniforms=u,
    )
    x = torch.einsum("hd,td->ht", q[0], case.keys[0][:, 0]) * 0.25
    want = torch.softmax((x + gumbel_from_uniform(u[0])) / 1.7, dim=-1).sum(0)
    torch.testing.assert_close(scores[0, 0], want)


def test_write_kv_reference_per_token_and_per_head_slots():
    k_cache = torch.zeros(4, 4, 2, 8)
    v_cache = torch.zeros(4, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv_reference(key, value, k_cache, v_cache, torch.tensor([5, -1, 15]))
    assert torch.equal(k_cache[1, 1], key[0]) and torch.equal(v_cache[3, 3], value[2])
    assert torch.count_nonzero(k_cache) == 2 * 2 * 8  # the skipped token wrote nothing
    per_head = torch.tensor([[0, 9], [-1, 2], [3, -1]])
    write_kv_reference(key, value, k_cache, v_cache, per_head)
    assert torch.equal(k_cache[0, 0, 0], key[0, 0]) and torch.equal(k_cache[2, 1, 1], key[0, 1])
    assert torch.equal(v_cache[0, 2, 1], value[1, 1]) and torch.equal(k_cache[0, 3, 0], key[2, 0])


@pytest.mark.parametrize("window", [None, 12])
def test_fast_cpu_path_equals_explicit_logits(window):
    """Without scores the reference runs fused SDPA on gathered blocks; with scores it builds
    the logits itself. Both give the same output (mixed lengths need the key mask, equal
    lengths take the sliced no-mask route)."""
    for lens in ([0, 3, 16, 50], [33, 33]):
        case = make_case(lens, 16, 3, 64, seed=len(lens))
        q = torch.randn(len(lens), 9, 64)
        args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125, window)
        fast, _ = paged_decode_attention_reference(*args)
        explicit, _ = paged_decode_attention_reference(*args, score_mode="softmax")
        torch.testing.assert_close(fast, explicit, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fast, dense_decode(case, q, 0.125, window), atol=1e-5, rtol=1e-5)


def test_fast_cpu_path_on_a_non_contiguous_cache():
    """A cache that is a strided view (padded head_dim) takes the token-major gather."""
    case = make_case([7, 30], 8, 2, 16, seed=9)
    padded_k = torch.zeros(*case.k_cache.shape[:3], 24)
    padded_v = torch.zeros(*case.v_cache.shape[:3], 24)
    padded_k[..., :16], padded_v[..., :16] = case.k_cache, case.v_cache
    q = torch.randn(2, 4, 16)
    args = (case.block_tables, case.context_lens, 0.25)
    out, _ = paged_decode_attention_reference(q, padded_k[..., :16], padded_v[..., :16], *args)
    torch.testing.assert_close(out, dense_decode(case, q, 0.25), atol=1e-5, rtol=1e-5)
    starts = torch.tensor([0, 3, 5], dtype=torch.int32)
    qp = torch.randn(5, 4, 16)
    out, _ = paged_prefill_attention_reference(
        qp, padded_k[..., :16], padded_v[..., :16], case.block_tables, starts, case.context_lens, 0.25)
    torch.testing.assert_close(out, dense_prefill(case, qp, starts.tolist(), 0.25), atol=1e-5, rtol=1e-5)


def test_reference_rejects_gumbel_without_tau():
    case = make_case([4], 8, 1, 16)
    args = (torch.randn(1, 2, 16), case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25)
    with pytest.raises(ValueError, match=r"^tau: score_mode='gumbel' needs"):
        paged_decode_attention_reference(*args, score_mode="gumbel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flash_lse", [True, False])
def test_chunk_after_a_prefix_two_flash_passes_equal_dense(monkeypatch, dtype, flash_lse):
    """A chunk after cached slots runs as prefix-unmasked + chunk-causal flash passes merged by
    log-sum-exp (or, without torch's private op, one masked pass): both equal dense attention.
    Lengths straddle ``SPLIT_MIN_QUERIES`` and leave partly filled blocks on both sides."""
    from keyserve.kernels import cpu_paths

    calls = []
    split = cpu_paths._prefix_then_causal
    monkeypatch.setattr(cpu_paths, "_prefix_then_causal", lambda *a: calls.append(a[3]) or split(*a))
    if not flash_lse:
        monkeypatch.setattr(cpu_paths, "_FLASH_LSE", None)
    lens, q_lens = [70, 93, 40, 45], [70, 61, 31, 1]  # fresh, split, below threshold, decode-like
    case = make_case(lens, 16, 3, 64, dtype=dtype, seed=4)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], 9, 64).to(dtype)
    out, _ = paged_prefill_attention_reference(
        q, case.k_cache, case.v_cache, case.block_tables, torch.tensor(starts, dtype=torch.int32),
        case.context_lens, 0.125,
    )
    want = dense_prefill(case, q.float(), starts, 0.125)
    torch.testing.assert_close(out.float(), want.float(), **tolerance(dtype))
    assert calls == ([93 - 61] if flash_lse else [])  # only the long chunk after a prefix splits
