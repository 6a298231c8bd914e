"""The native C kernels (decode attention with and without scores, KV write) against the
pure-torch reference, on the layouts and edge cases the engine produces."""

from __future__ import annotations

import pytest
import torch

from keyserve.kernels import reference as ref
from keyserve.kernels.native import library
from keyserve.kernels.native.decode import paged_decode_attention_native, supports
from keyserve.kernels.native.write_kv import write_kv_native

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: native kernels not built")

H, HKV, D, BS, NB = 9, 3, 64, 16, 48


def _case(dtype: torch.dtype, lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NB, BS, HKV, D, generator=g).to(dtype)
    v = torch.randn(NB, BS, HKV, D, generator=g).to(dtype)
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    max_blocks = max(1, (max(lens) + BS - 1) // BS)
    tables = torch.stack([torch.randperm(NB, generator=g)[:max_blocks] for _ in lens]).int()
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("score_mode", [None, "softmax", "gumbel"])
def test_decode_equals_reference(dtype: torch.dtype, window: int | None, score_mode: str | None) -> None:
    lens = [1, 16, 17, 0, 200, 33]  # partial and full last blocks, an empty sequence
    q, k, v, tables, ctx = _case(dtype, lens)
    tau = torch.linspace(0.5, 2.0, len(lens))
    u = torch.rand(len(lens), H, max(lens), generator=torch.Generator().manual_seed(1))
    # The reference's explicit-logits path (float32 math) is the oracle for every mode: its
    # score-free mode routes to SDPA, so compare outputs against a scored call.
    want_out, want_scores = ref.paged_decode_attention_reference(
        q, k, v, tables, ctx, 0.125, window, score_mode=score_mode or "softmax", tau=tau, uniforms=u)
    out, scores = paged_decode_attention_native(
        q, k, v, tables, ctx, 0.125, window, score_mode=score_mode, tau=tau, uniforms=u)
    assert out.dtype == dtype and out.shape == (len(lens), H, D)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output is rounded once
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    assert torch.all(out[3] == 0)
    if score_mode is None:
        assert scores is None
    else:
        torch.testing.assert_close(scores, want_scores, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 3, 64), (12, 1, 32), (12, 2, 64), (8, 2, 128), (4, 4, 48), (20, 2, 16)])
@pytest.mark.parametrize("score_mode", [None, "gumbel"])
@pytest.mark.parametrize("num_seqs", [3, 12])
def test_decode_shapes_and_work_splits(dtype: torch.dtype, shape: tuple[int, int, int], score_mode: str | None,
                                       num_seqs: int) -> None:
    """attend.h's vector passes against the reference for head dims that fill whole vector
    tiles (64, 128), half tiles (16, 32, 48: the scalar fallbacks), query groups larger than
    one register tile (12 heads; with 2 kv heads the second tile starts inside the
    second kv head's group), and both work splits of paged_decode.c: a
    sequence's kv heads as one work item (12 sequences) or one item per kv head (3)."""
    h, hkv, d = shape
    g = torch.Generator().manual_seed(7)
    lens = [int(x) for x in torch.randint(1, 90, (num_seqs,), generator=g)]
    nb = sum((n + BS - 1) // BS for n in lens) + 4
    k = (torch.randn(nb, BS, hkv, d, generator=g) * 2).to(dtype)
    v = torch.randn(nb, BS, hkv, d, generator=g).to(dtype)
    q = torch.randn(num_seqs, h, d, generator=g).to(dtype)
    mb = max((n + BS - 1) // BS for n in lens) + 1
    tables = torch.stack([torch.randperm(nb, generator=g)[:mb] for _ in lens]).int()
    ctx = torch.tensor(lens, dtype=torch.int32)
    tau = torch.linspace(0.5, 2.0, num_seqs)
    u = torch.rand(num_seqs, h, max(lens), generator=g)
    want_out, want_scores = ref.paged_decode_attention_reference(
        q, k, v, tables, ctx, d**-0.5, None, score_mode=score_mode or "softmax", tau=tau, uniforms=u)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # 12 sequences >= 4 x 2 threads: kv heads together; 3: split
    try:
        out, scores = paged_decode_attention_native(
            q, k, v, tables, ctx, d**-0.5, None, score_mode=score_mode, tau=tau, uniforms=u)
    finally:
        torch.set_num_threads(threads)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    if score_mode is not None:
        torch.testing.assert_close(scores, want_scores, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 8, 32, 48])
@pytest.mark.parametrize("window", [None, 37])
def test_decode_block_sizes(dtype: torch.dtype, block_size: int, window: int | None) -> None:
    """attend.h walks the slots in runs of at most one vector's width (16 slots with AVX-512, 8
    with AVX2) inside a block: blocks narrower than a run (1, 8: every run partial), wider ones
    (32, 48: several runs per block, the next run's prefetch inside the same block) and a
    window starting inside a block, with scores, against the reference."""
    g = torch.Generator().manual_seed(11)
    lens = [1, 15, 16, 17, 95, 130]
    nb = sum((n + block_size - 1) // block_size for n in lens) + 3
    k = torch.randn(nb, block_size, HKV, D, generator=g).to(dtype)
    v = torch.randn(nb, block_size, HKV, D, generator=g).to(dtype)
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    mb = max((n + block_size - 1) // block_size for n in lens)
    tables = torch.stack([torch.randperm(nb, generator=g)[:mb] for _ in lens]).int()
    ctx = torch.tensor(lens, dtype=torch.int32)
    want_out, want_scores = ref.paged_decode_attention_reference(
        q, k, v, tables, ctx, 0.125, window, score_mode="softmax")
    out, scores = paged_decode_attention_native(q, k, v, tables, ctx, 0.125, window, score_mode="softmax")
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(scores, want_scores, atol=1e-5, rtol=1e-5)


def test_decode_matches_sdpa_path_at_batch() -> None:
    """Many sequences of very different lengths, against the engine's torch fast path."""
    lens = [int(x) for x in torch.randint(1, 700, (24,), generator=torch.Generator().manual_seed(3))]
    q, k, v, tables, ctx = _case(torch.float32, lens, seed=3)
    k = torch.randn(64, BS, HKV, D).repeat(12, 1, 1, 1)  # enough blocks for 700 slots
    v = torch.randn_like(k)
    tables = torch.stack([torch.randperm(k.shape[0])[:44] for _ in lens]).int()
    want, _ = ref.paged_decode_attention_reference(q, k, v, tables, ctx, 0.125)
    got, _ = paged_decode_attention_native(q, k, v, tables, ctx, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_gumbel_without_uniforms_is_seeded_and_a_distribution() -> None:
    lens = [50, 120]
    q, k, v, tables, ctx = _case(torch.float32, lens)
    tau = torch.tensor([1.0, 0.7])
    torch.manual_seed(5)
    _, a = paged_decode_attention_native(q, k, v, tables, ctx, 0.125, score_mode="gumbel", tau=tau)
    torch.manual_seed(5)
    _, b = paged_decode_attention_native(q, k, v, tables, ctx, 0.125, score_mode="gumbel", tau=tau)
    _, c = paged_decode_attention_native(q, k, v, tables, ctx, 0.125, score_mode="gumbel", tau=tau)
    assert torch.equal(a, b) and not torch.equal(a, c)
    group = H // HKV
    torch.testing.assert_close(a.sum(-1), torch.full((2, HKV), float(group)), atol=1e-4, rtol=0)
    assert torch.all(a[0, :, 50:] == 0)  # past the sequence's end


def test_gumbel_noise_has_the_gumbel_mean() -> None:
    """Averaged over draws, softmax((x + ζ)/τ) with τ = 1 and one slot pair reproduces the
    Gumbel-max probabilities softmax(x) (the Gumbel trick in expectation is not exact for
    the soft version, so compare argmax frequencies: P(argmax = i) = softmax(x)_i)."""
    q, k, v, tables, ctx = _case(torch.float32, [8])
    _, exact = ref.paged_decode_attention_reference(q, k, v, tables, ctx, 0.125, score_mode="softmax")
    counts = torch.zeros(8)
    draws = 3000
    tau = torch.tensor([1e-3])  # near-zero temperature: the scores become one-hot argmaxes
    for _ in range(draws):
        _, s = paged_decode_attention_native(q[:, :1].repeat(1, H, 1), k, v, tables, ctx, 0.125,
                                             score_mode="gumbel", tau=tau)
        counts += s[0, 0] / (H // HKV)
    q1 = q[:, :1].repeat(1, H, 1)
    _, p = ref.paged_decode_attention_reference(q1, k, v, tables, ctx, 0.125, score_mode="softmax")
    expected = p[0, 0] / (H // HKV)
    assert exact is not None
    assert torch.allclose(counts / draws, expected, atol=0.035)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_head", [False, True])
def test_write_kv_equals_reference(dtype: torch.dtype, per_head: bool) -> None:
    g = torch.Generator().manual_seed(2)
    n = 7
    key, value = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
    if per_head:
        slots = torch.randperm(NB * BS, generator=g)[: n * HKV].view(n, HKV)
        slots[2, 1] = -1
    else:
        slots = torch.randperm(NB * BS, generator=g)[:n]
        slots[4] = -1
    caches = [torch.randn(NB, BS, HKV, D, generator=g).to(dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    ref.write_kv_reference(key, value, want[0], want[1], slots)
    write_kv_native(key, value, caches[0], caches[1], slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])


@pytest.mark.parametrize("per_head", [False, True])
def test_write_kv_rejects_out_of_range_slots(per_head: bool) -> None:
    """A slot past the cache, anywhere in the mapping (here the last token's, or one kv head's),
    is refused before anything is written: the valid first token's rows stay unwritten."""
    k, v = torch.zeros(NB, BS, HKV, D), torch.zeros(NB, BS, HKV, D)
    slots = torch.tensor([0, NB * BS])
    if per_head:
        slots = torch.tensor([[0, 1, 2], [3, NB * BS + 5, 4]])
    with pytest.raises(IndexError, match=f"slot {NB * BS + (5 if per_head else 0)} out of range"):
        write_kv_native(torch.ones(2, HKV, D), torch.ones(2, HKV, D), k, v, slots)
    assert not k.any() and not v.any()


def test_supports_only_cpu_contiguous_float32_or_bf16() -> None:
    q = torch.zeros(1, H, D)
    assert supports(q, torch.zeros(2, BS, HKV, D))
    assert supports(q, torch.zeros(2, BS, HKV, D, dtype=torch.bfloat16))
    assert not supports(q, torch.zeros(2, BS, HKV, D, dtype=torch.float16))
    assert not supports(q, torch.zeros(2, HKV, BS, D).transpose(1, 2))


def test_env_switches_take_the_usual_words_and_refuse_typos(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KEYSERVE_PACKED_LINEAR=off`` used to leave it on (only "0" counted there), and a typo
    silently meant "on" everywhere."""
    from keyserve.kernels.native import env_switch

    for off in ("0", "false", "NO", "off", " Off "):
        monkeypatch.setenv("KEYSERVE_TEST_SWITCH", off)
        assert env_switch("KEYSERVE_TEST_SWITCH") is False
    for on in ("1", "true", "Yes", "on"):
        monkeypatch.setenv("KEYSERVE_TEST_SWITCH", on)
        assert env_switch("KEYSERVE_TEST_SWITCH") is True
    monkeypatch.delenv("KEYSERVE_TEST_SWITCH")
    assert env_switch("KEYSERVE_TEST_SWITCH") is True
    monkeypatch.setenv("KEYSERVE_TEST_SWITCH", "banana")
    with pytest.raises(ValueError, match=r"\$KEYSERVE_TEST_SWITCH must be 0/1"):
        env_switch("KEYSERVE_TEST_SWITCH")
