"""The CPU fast prefill-with-scores path (SDPA + chunked score matmuls) against the reference."""

from __future__ import annotations

import pytest
import torch

from keyserve.kernels import cpu_paths
from keyserve.kernels import reference as ref

H, HKV, D, BS, NB = 6, 2, 32, 8, 40


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("score_mode", ["softmax", "gumbel"])
@pytest.mark.parametrize("chunk_bytes", [1 << 10, 16 << 20])  # many query chunks, or one
def test_prefill_scores_equal_reference(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, window: int | None, score_mode: str, chunk_bytes: int
) -> None:
    monkeypatch.setattr(cpu_paths, "SCORE_CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(7)
    k = torch.randn(NB, BS, HKV, D, generator=g).to(dtype)
    v = torch.randn(NB, BS, HKV, D, generator=g).to(dtype)
    q_lens, ctx = [5, 1, 19, 0], [5, 30, 40, 9]  # fresh prompt, decode-like, chunk after a prefix, empty
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], H, D, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(NB, generator=g)[:6] for _ in q_lens]).int()
    tau = torch.tensor([0.6, 1.0, 1.7, 1.0])
    u = torch.rand(starts[-1], H, max(ctx), generator=g)
    want_out, want = ref.paged_prefill_attention_reference(
        query, k, v, tables, torch.tensor(starts, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32),
        0.2, window, score_mode=score_mode, tau=tau, uniforms=u)
    out, got = cpu_paths.prefill_sdpa_scores(query, k, v, tables, starts, ctx, 0.2, window, score_mode, tau, u)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # every query's distribution sums to 1 per head: group heads x queries in total
    torch.testing.assert_close(got.sum(-1), torch.tensor(q_lens, dtype=torch.float32)[:, None].expand(-1, HKV) * (H // HKV))
