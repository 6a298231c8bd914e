"""The launchers refuse bad arguments with a ValueError that names the argument."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be run")

from paged_cases import make_case  # noqa: E402


@pytest.fixture
def decode_args():
    case = make_case([5, 20], 8, 2, 16, seed=3)
    q = torch.randn(2, 4, 16)
    return [q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25]


def _with(args: list, i: int, value: object) -> list:
    args = list(args)
    args[i] = value
    return args


@pytest.mark.parametrize(
    "index,make_bad,message",
    [
        (0, lambda a: a[0].transpose(1, 2).contiguous().transpose(1, 2), r"^query: last dim must be contiguous"),
        (0, lambda a: a[0][:, :3], r"^query: num_heads 3 is not a multiple of .* num_kv_heads 2"),
        (0, lambda a: a[0].long(), r"^query: dtype torch.int64 not in"),
        (1, lambda a: a[1].half(), r"^k_cache: dtype torch.float16 not in \['torch.float32'\]"),
        (2, lambda a: a[2][:, :4], r"^v_cache: shape .* differs from k_cache"),
        (3, lambda a: a[3].float(), r"^block_tables: dtype torch.float32"),
        (4, lambda a: a[4][:1], r"^context_lens: has 1 entries but block_tables has 2 rows"),
        (5, lambda a: 0.0, r"^scale: expected a positive float"),
    ],
)
def test_decode_rejects(triton_kernels, decode_args, index, make_bad, message):
    with pytest.raises(ValueError, match=message):
        triton_kernels.paged_decode_attention(*_with(decode_args, index, make_bad(decode_args)))


def test_decode_value_checks_with_scores(triton_kernels, decode_args):
    """Checks of the values (not the layout) of the metadata need a host sync; the launcher
    makes one only when scores are requested (their shape needs max(context_lens))."""
    fn = triton_kernels.paged_decode_attention
    with pytest.raises(ValueError, match=r"^block_tables: 1 blocks of 8 slots cover 8 slots, but the longest context is 20"):
        fn(*_with(decode_args, 3, decode_args[3][:, :1]), score_mode="softmax")
    with pytest.raises(ValueError, match=r"^context_lens: has a negative entry"):
        fn(*_with(decode_args, 4, torch.tensor([5, -1], dtype=torch.int32)), score_mode="softmax")


def test_decode_rejects_score_arguments(triton_kernels, decode_args):
    fn = triton_kernels.paged_decode_attention
    with pytest.raises(ValueError, match=r"^tau: score_mode='gumbel' needs"):
        fn(*decode_args, score_mode="gumbel")
    with pytest.raises(ValueError, match=r"^score_mode: expected one of"):
        fn(*decode_args, score_mode="h2o")
    with pytest.raises(ValueError, match=r"^sliding_window: expected None or a positive int"):
        fn(*decode_args, sliding_window=0)
    with pytest.raises(ValueError, match=r"^uniforms: shape \(2, 4, 7\), expected \[num_seqs, num_heads, max_context\] = \(2, 4, 20\)"):
        fn(*decode_args, score_mode="gumbel", tau=torch.ones(2), uniforms=torch.rand(2, 4, 7))


def test_cpu_tensors_need_the_interpreter(decode_args, monkeypatch):
    kernels = importlib.import_module("keyserve.kernels.paged_attention")  # no device wrapper
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"^query: is on cpu; the Triton kernels need CUDA tensors"):
        kernels.paged_decode_attention(*decode_args)


def test_prefill_rejects(triton_kernels):
    case = make_case([5, 20], 8, 2, 16, seed=3)
    q = torch.randn(8, 4, 16)
    base = [q, case.k_cache, case.v_cache, case.block_tables, None, case.context_lens, 0.25]
    fn = triton_kernels.paged_prefill_attention
    with pytest.raises(ValueError, match=r"^query_start_loc: has 2 entries, expected num_seqs \+ 1 = 3"):
        fn(*_with(base, 4, torch.tensor([0, 8], dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"^query_start_loc: must rise from 0 to num_tokens = 8"):
        fn(*_with(base, 4, torch.tensor([0, 3, 7], dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"^context_lens: is shorter than the query length"):
        fn(*_with(base, 4, torch.tensor([0, 6, 8], dtype=torch.int32)))


def test_write_kv_rejects(triton_kernels):
    k_cache = torch.zeros(4, 8, 2, 16)
    v_cache = torch.zeros(4, 8, 2, 16)
    key = torch.randn(3, 2, 16)
    fn = triton_kernels.write_kv
    with pytest.raises(ValueError, match=r"^slot_mapping: dtype torch.float32 not in"):
        fn(key, key, k_cache, v_cache, torch.zeros(3))
    with pytest.raises(ValueError, match=r"^slot_mapping: shape \(3, 3\), expected \(3, 2\)"):
        fn(key, key, k_cache, v_cache, torch.zeros(3, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^key: last dim must be contiguous"):
        fn(key.transpose(0, 2).contiguous().transpose(0, 2), key, k_cache, v_cache,
           torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^value: shape \(3, 2, 8\) differs from key"):
        fn(key, key[..., :8], k_cache, v_cache, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^key: \[num_tokens, num_kv_heads, head_dim\] = \(3, 2, 16\) does not match"):
        fn(key, key, k_cache[:, :, :1], v_cache[:, :, :1], torch.zeros(3, dtype=torch.int64))
