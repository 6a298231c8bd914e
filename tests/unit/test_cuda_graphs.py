"""Which steps the CUDA graphs of decode steps take, and their padded batch sizes (pure logic;
the graphs themselves are tested on a GPU in tests/engine/test_cuda_engine.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from keyserve.engine.cuda_graphs import BUCKETS, bucket_for, graphable
from keyserve.kernels.metadata import AttentionMetadata


def _decode_meta(n: int, width: int = 4) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.arange(n), num_decode_seqs=n,
        decode_block_tables=torch.zeros(n, width, dtype=torch.int32),
        decode_context_lens=torch.ones(n, dtype=torch.int32),
        prefill_block_tables=torch.zeros(0, width, dtype=torch.int32),
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
        prefill_context_lens=torch.zeros(0, dtype=torch.int32),
    )


@pytest.mark.parametrize(("rows", "cap", "want"), [
    (1, 256, 1), (3, 256, 4), (8, 256, 8), (9, 256, 16), (17, 256, 24), (65, 256, 96),
    (256, 256, 256), (257, 256, None), (40, 32, None), (5, 4, None), (4, 4, 4),
])
def test_bucket_is_the_smallest_that_fits(rows: int, cap: int, want: int | None) -> None:
    assert bucket_for(rows, cap) == want


def test_buckets_rise() -> None:
    assert list(BUCKETS) == sorted(set(BUCKETS)) and BUCKETS[0] == 1


def test_plain_decode_is_graphable() -> None:
    assert graphable(_decode_meta(5), 5, max_blocks=4)


def test_what_stays_eager() -> None:
    meta = _decode_meta(5)
    assert not graphable(meta, 6, 4)  # a prefill chunk's tokens beside the decode rows
    assert not graphable(meta, 5, 3)  # tables wider than the static buffer
    assert not graphable(dataclasses.replace(meta, score_mode="softmax"), 5, 4)  # KV-budget scores
    assert not graphable(dataclasses.replace(meta, noise_keys=torch.zeros(5, 2, dtype=torch.int64)), 5, 4)
    assert not graphable(dataclasses.replace(meta, slot_mapping=torch.zeros(5, 3, dtype=torch.int64)), 5, 4)
    assert not graphable(dataclasses.replace(meta, decode_context_lens=torch.ones(2, 5, dtype=torch.int32)), 5, 4)
    with_prefill = dataclasses.replace(meta, prefill_block_tables=torch.zeros(1, 4, dtype=torch.int32))
    assert not graphable(with_prefill, 5, 4)
    assert not graphable(_decode_meta(0), 0, 4)
