"""In-kernel score output for KV budgets: H2O softmax and Keyformer Gumbel scores."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be run")

from paged_cases import make_case  # noqa: E402

from keyserve.kernels import noise  # noqa: E402
from keyserve.kernels.reference import (  # noqa: E402
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
)

SCORE_TOL = {"atol": 2e-5, "rtol": 1e-4}


@pytest.mark.parametrize(
    "mode,split_k,window",
    [("softmax", False, None), ("gumbel", False, 20), ("softmax", True, 20), ("gumbel", True, None)],
)
def test_decode_scores_match_reference(triton_kernels, mode, split_k, window):
    case = make_case([0, 1, 37, 70], 8, 3, 64, seed=5)
    q = torch.randn(4, 9, 64)
    tau = torch.tensor([1.0, 1.3, 1.7, 2.0])
    u = torch.rand(4, 9, 70)  # the same Gumbel draws for both
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125, window)
    out, scores = triton_kernels.paged_decode_attention(
        *args, score_mode=mode, tau=tau, uniforms=u, split_k=split_k, partition_size=16)
    want_out, want = paged_decode_attention_reference(*args, score_mode=mode, tau=tau, uniforms=u)
    assert scores.shape == (4, 3, 70) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, want, **SCORE_TOL)
    torch.testing.assert_close(out, want_out, atol=3e-5, rtol=1e-4)  # scores leave out untouched


@pytest.mark.parametrize("mode,window", [("softmax", None), ("gumbel", None), ("gumbel", 6)])
def test_prefill_scores_match_reference(triton_kernels, mode, window):
    case = make_case([21, 30, 5], 16, 2, 64, seed=6)
    starts = torch.tensor([0, 21, 34, 35], dtype=torch.int32)  # prompt, chunk after prefix, 1 token
    q = torch.randn(35, 8, 64)
    tau = torch.tensor([1.0, 1.5, 2.0])
    u = torch.rand(35, 8, 30)
    args = (q, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens, 0.125,
            window)
    _, scores = triton_kernels.paged_prefill_attention(*args, score_mode=mode, tau=tau, uniforms=u)
    _, want = paged_prefill_attention_reference(*args, score_mode=mode, tau=tau, uniforms=u)
    torch.testing.assert_close(scores, want, **SCORE_TOL)


def _same_sequence_batch(num_seqs: int, ctx: int, group: int, seed: int):
    """``num_seqs`` copies of one sequence (same blocks, same query): independent samples of
    the Gumbel scores of one attention row per launch."""
    case = make_case([ctx], 8, 1, 16, seed=seed)
    tables = case.block_tables.expand(num_seqs, -1).contiguous()
    lens = case.context_lens.expand(num_seqs).contiguous()
    q = (torch.randn(1, group, 16, generator=torch.Generator().manual_seed(seed)) * 2).expand(
        num_seqs, -1, -1).contiguous()
    return q, case, tables, lens


def _assert_same_distribution(kernel: torch.Tensor, ref: torch.Tensor, spread: float) -> None:
    """Per slot, means agree within 5 standard errors and standard deviations within a factor
    ``1 ± spread`` (the scores are skewed, so a small sample's spread is itself noisy)."""
    se = (kernel.var(0) / kernel.shape[0] + ref.var(0) / ref.shape[0]).sqrt()
    diff = (kernel.mean(0) - ref.mean(0)).abs()
    assert torch.all(diff <= 5 * se + 1e-3), (diff / se).max()
    ratio = kernel.std(0) / ref.std(0)
    assert torch.all((ratio > 1 - spread) & (ratio < 1 + spread)), ratio


def _keys(num_seqs: int, seed: int) -> torch.Tensor:
    return noise.random_keys(num_seqs, torch.Generator().manual_seed(seed))


def test_decode_gumbel_rng_statistics(triton_kernels):
    """The kernel's hashed noise (``kernels/noise.py``) gives the same score distribution as
    the reference fed torch.rand uniforms (Monte Carlo), and the same keys reproduce its draws
    exactly."""
    num_seqs, ctx, group = 16, 12, 8
    q, case, tables, lens = _same_sequence_batch(num_seqs, ctx, group, seed=8)
    tau = torch.full((num_seqs,), 1.5)
    args = (q, case.k_cache, case.v_cache, tables, lens, 0.25)
    samples = []
    for seed in range(5):
        _, s = triton_kernels.paged_decode_attention(*args, score_mode="gumbel", tau=tau,
                                                     noise_keys=_keys(num_seqs, seed))
        samples.append(s[:, 0])
    kernel = torch.cat(samples)  # [80, ctx]
    torch.manual_seed(0)
    big = 4096
    _, ref = paged_decode_attention_reference(
        q[:1].expand(big, -1, -1), case.k_cache, case.v_cache, tables[:1].expand(big, -1),
        lens[:1].expand(big), 0.25, score_mode="gumbel", tau=torch.full((big,), 1.5),
        uniforms=torch.rand(big, group, ctx))
    _assert_same_distribution(kernel, ref[:, 0], spread=0.35)
    _, plain = paged_decode_attention_reference(*args[:1], *args[1:], score_mode="softmax")
    assert (kernel.mean(0) - plain[0, 0]).abs().max() > 0.02  # the noise is really there
    _, again = triton_kernels.paged_decode_attention(*args, score_mode="gumbel", tau=tau,
                                                     noise_keys=_keys(num_seqs, 0))
    assert torch.equal(again[:, 0], samples[0])
    assert not torch.equal(samples[0][0], samples[0][1])  # each sequence draws its own noise


def test_prefill_gumbel_rng_statistics(triton_kernels):
    """Chunked prefill: the score is a sum over the chunk's queries; compare its distribution."""
    num_seqs, ctx, q_len, group = 4, 14, 8, 4
    case = make_case([ctx], 8, 1, 16, seed=9)
    gen = torch.Generator().manual_seed(9)
    chunk = torch.randn(q_len, group, 16, generator=gen) * 2
    q = chunk.repeat(num_seqs, 1, 1)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32) * q_len
    tables = case.block_tables.expand(num_seqs, -1).contiguous()
    lens = case.context_lens.expand(num_seqs).contiguous()
    tau = torch.full((num_seqs,), 1.2)
    samples = [
        triton_kernels.paged_prefill_attention(
            q, case.k_cache, case.v_cache, tables, starts, lens, 0.25, score_mode="gumbel",
            tau=tau, noise_keys=_keys(num_seqs, seed))[1][:, 0]
        for seed in range(8)
    ]
    kernel = torch.cat(samples)  # [32, ctx]
    big = 160  # the reference loops over sequences: keep the Monte-Carlo sample modest
    torch.manual_seed(1)
    _, ref = paged_prefill_attention_reference(
        chunk.repeat(big, 1, 1), case.k_cache, case.v_cache, tables[:1].expand(big, -1),
        torch.arange(big + 1, dtype=torch.int32) * q_len, lens[:1].expand(big), 0.25,
        score_mode="gumbel", tau=torch.full((big,), 1.2), uniforms=torch.rand(big * q_len, group, ctx))
    _assert_same_distribution(kernel, ref[:, 0], spread=0.6)
