"""Keyformer's Gumbel noise is one function of (row seed, layer and head, query position, slot)
(``keyserve/kernels/noise.py``), the same in the pure-torch reference, the CPU fast prefill
path, the native C decode kernel and the Triton kernels, and a row's noise does not depend on
the other rows of its batch."""

from __future__ import annotations

import math

import pytest
import torch
from paged_cases import make_case

from keyserve.kernels import cpu_paths, noise
from keyserve.kernels import reference as ref
from keyserve.kernels.native import library

M32 = 0xFFFFFFFF
SCORE_TOL = {"atol": 2e-5, "rtol": 1e-4}
LAYER = noise.layer_key(3, 6)  # layer 3, this rank's first query head 6


def _mix(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _uniform(seed: int, head_key: int, pos: int, slot: int) -> float:
    """The documented function in plain Python ints: the oracle for the torch version."""
    row = _mix(_mix(seed ^ _mix(head_key)) ^ (pos & M32))
    bits = _mix((row + slot * 0x9E3779B9) & M32)
    return ((bits >> 9) + 0.5) / 2**23


def test_torch_hash_equals_the_documented_function() -> None:
    """The int64 torch emulation of uint32 arithmetic (16-bit split products) against Python's
    exact integers, over seeds and keys that reach the top bit."""
    cases = [(0, 0, 0, 0), (1, 2, 3, 4), (M32, M32, M32, 7), (0xDEADBEEF, noise.layer_key(29, 40) + 5, 2047, 1999),
             (noise.request_seed(2**63 - 1, 3), 65535, 123456, 65536)]
    for seed, head, pos, slot in cases:
        rows = noise.row_keys(torch.tensor(seed), head, pos)
        got = noise.uniforms(rows[None], torch.tensor([slot]))[0].item()
        assert got == _uniform(seed, head, pos, slot)
    u = noise.chunk_uniforms(77, 10, LAYER, 4, range(2, 5), range(3, 9))
    want = torch.tensor([[[_uniform(77, LAYER + h, 10 + j, t) for t in range(3, 9)] for j in range(2, 5)]
                         for h in range(4)])
    assert torch.equal(u, want)
    assert 0.0 < u.min() and u.max() < 1.0


def test_request_seed_and_gumbel_statistics() -> None:
    """Different requests and samples get different 32-bit seeds, and the hash's uniforms make
    Gumbel noise with its mean (Euler's gamma) and variance (pi^2 / 6)."""
    seeds = {noise.request_seed(s, i) for s in range(50) for i in range(4)}
    assert len(seeds) == 200 and all(0 <= s <= M32 for s in seeds)
    u = noise.decode_uniforms(noise.random_keys(64, torch.Generator().manual_seed(0)), LAYER, 8, 512)
    z = ref.gumbel_from_uniform(u.double())
    assert abs(z.mean().item() - 0.5772157) < 0.01
    assert abs(z.var().item() - math.pi**2 / 6) < 0.03


def _decode_inputs():
    case = make_case([0, 1, 37, 70, 9], 8, 3, 16, seed=5)
    q = torch.randn(5, 6, 16, generator=torch.Generator().manual_seed(5))
    tau = torch.tensor([0.7, 1.0, 1.5, 2.0, 1.2])
    keys = torch.tensor([[11, 5], [22, 6], [33, 40], [0xFFFFFFFF, 77], [44, 9]])
    return case, q, tau, keys


def _prefill_inputs():
    lens, q_lens = [21, 30, 5], [4, 30, 2]
    case = make_case(lens, 16, 2, 16, seed=6)
    q = torch.randn(sum(q_lens), 4, 16, generator=torch.Generator().manual_seed(6))
    starts = torch.tensor([0, 4, 34, 36], dtype=torch.int32)
    tau = torch.tensor([1.0, 1.3, 0.9])
    keys = torch.tensor([[5, 17], [6, 0], [7, 3]])
    return case, q, starts, tau, keys


def test_reference_noise_is_the_hash_and_per_row() -> None:
    """The reference's decode scores with keys equal its scores with the hash's uniforms
    passed in, and a row's scores are the same alone as in its batch (a row left out changes
    nothing of the others). Mutation caught: ``decode_uniforms`` ignoring the position column
    (``keys[:, 0, None, None]`` for both)."""
    case, q, tau, keys = _decode_inputs()
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25)
    _, got = ref.paged_decode_attention_reference(*args, score_mode="gumbel", tau=tau, noise_keys=keys,
                                                  noise_layer=LAYER)
    max_ctx = int(case.context_lens.max())
    u = torch.tensor([[[_uniform(int(s), LAYER + h, int(p), t) for t in range(max_ctx)] for h in range(6)]
                      for s, p in keys.tolist()])
    _, want = ref.paged_decode_attention_reference(*args, score_mode="gumbel", tau=tau, uniforms=u)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for i in range(5):
        one = (q[i : i + 1], case.k_cache, case.v_cache, case.block_tables[i : i + 1], case.context_lens[i : i + 1], 0.25)
        _, alone = ref.paged_decode_attention_reference(*one, score_mode="gumbel", tau=tau[i : i + 1],
                                                        noise_keys=keys[i : i + 1], noise_layer=LAYER)
        n = int(case.context_lens[i])
        torch.testing.assert_close(alone[0, :, :n], got[i, :, :n], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("split_k", [False, True])
def test_triton_decode_noise_equals_reference(triton_kernels, split_k: bool) -> None:
    """Mutation caught: ``_noise_rows`` keying by the local head (``heads`` without
    ``noise_layer``)."""
    case, q, tau, keys = _decode_inputs()
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25)
    kw = dict(score_mode="gumbel", tau=tau, noise_keys=keys, noise_layer=LAYER)
    _, want = ref.paged_decode_attention_reference(*args, **kw)
    _, got = triton_kernels.paged_decode_attention(*args, **kw, split_k=split_k, partition_size=16)
    torch.testing.assert_close(got, want, **SCORE_TOL)
    _, other_layer = triton_kernels.paged_decode_attention(*args, **{**kw, "noise_layer": LAYER + (1 << 16)})
    assert (other_layer - want).abs().max() > 0.05  # the layer is part of the key


@pytest.mark.parametrize("window", [None, 6])
def test_prefill_noise_equals_reference_on_every_path(triton_kernels, monkeypatch: pytest.MonkeyPatch,
                                                      window: int | None) -> None:
    """Reference, CPU fast path (its native noise and its torch fallback) and Triton give the
    same Keyformer prefill scores from the same keys (query j of a chunk at position
    ``first + j``). Mutations caught: Triton's ``_noise_rows`` dropping the row's query index
    (``pos = pos0``), and ``keyserve_gumbel_noise`` doing the same (``pos0`` for ``pos0 + j``)."""
    case, q, starts, tau, keys = _prefill_inputs()
    args = (q, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens, 0.25, window)
    kw = dict(score_mode="gumbel", tau=tau, noise_keys=keys, noise_layer=LAYER)
    _, want = ref.paged_prefill_attention_reference(*args, **kw)
    for native in (True, False):
        if not native:
            monkeypatch.setattr(cpu_paths.native_decode, "library", lambda: None)
        _, fast = cpu_paths.prefill_sdpa_scores(q, case.k_cache, case.v_cache, case.block_tables, starts.tolist(),
                                                case.context_lens.tolist(), 0.25, window, "gumbel", tau,
                                                noise_keys=keys, noise_layer=LAYER)
        torch.testing.assert_close(fast, want, **SCORE_TOL)
    _, got = triton_kernels.paged_prefill_attention(*args, **kw)
    torch.testing.assert_close(got, want, **SCORE_TOL)
    # The second sequence alone, its chunk split in two at a different batch position: the
    # same scores (positions, not rows of the launch, key the noise).
    i, split = 1, 13
    first = q[4:34]
    one = (case.k_cache, case.v_cache, case.block_tables[1:2])
    ctx = int(case.context_lens[1])
    prefix = ctx - 30
    _, a = ref.paged_prefill_attention_reference(
        first[:split], *one, torch.tensor([0, split], dtype=torch.int32), torch.tensor([prefix + split], dtype=torch.int32),
        0.25, window, score_mode="gumbel", tau=tau[i : i + 1], noise_keys=torch.tensor([[6, 0]]), noise_layer=LAYER)
    _, b = triton_kernels.paged_prefill_attention(
        first[split:], *one, torch.tensor([0, 30 - split], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32),
        0.25, window, score_mode="gumbel", tau=tau[i : i + 1], noise_keys=torch.tensor([[6, split]]), noise_layer=LAYER)
    summed = b.clone()
    summed[:, :, : prefix + split] += a
    torch.testing.assert_close(summed[0], want[1, :, :ctx], **SCORE_TOL)


@pytest.mark.skipif(library() is None, reason="no C compiler: native kernels not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_noise_equals_reference(dtype: torch.dtype) -> None:
    """Mutation caught: ``paged_decode.c`` keying the noise by the kv-head (``kh``) instead of
    the query head (``kh * group + g``)."""
    from keyserve.kernels.native.decode import paged_decode_attention_native

    case, q, tau, keys = _decode_inputs()
    args = (q.to(dtype), case.k_cache.to(dtype), case.v_cache.to(dtype), case.block_tables, case.context_lens, 0.25)
    for window in (None, 5):
        kw = dict(score_mode="gumbel", tau=tau, noise_keys=keys, noise_layer=LAYER)
        _, want = ref.paged_decode_attention_reference(*args, window, **kw)
        _, got = paged_decode_attention_native(*args, window, **kw)
        torch.testing.assert_close(got, want, **SCORE_TOL)
        _, first_three = paged_decode_attention_native(
            args[0][:3], *args[1:3], args[3][:3], args[4][:3], 0.25, window, score_mode="gumbel", tau=tau[:3],
            noise_keys=keys[:3], noise_layer=LAYER)
        torch.testing.assert_close(first_three, got[:3, :, : first_three.shape[2]], atol=1e-6, rtol=1e-6)
