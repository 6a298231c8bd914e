"""Huge-page placement (kernels/huge_pages.py): the same bytes, on advised 2 MB pages.

Whether the kernel then backs a region with huge pages depends on free memory, so the tests
check what keyserve controls: the region's ``hg`` flag in ``/proc/self/smaps`` (madvise'd
MADV_HUGEPAGE), alignment, values, and that tied weights stay tied."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from keyserve.kernels import huge_pages
from keyserve.model.config import ModelConfig
from keyserve.model.kv_cache import allocate_kv_cache

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages here")


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping that holds ``address`` (this process's smaps)."""
    inside = False
    with open("/proc/self/smaps", encoding="utf-8") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"address {address:#x} is in no mapping")


@needs_thp
def test_empty_is_aligned_and_advised() -> None:
    t = huge_pages.empty(3 * (1 << 20), torch.float32)  # 12 MB
    assert t.numel() == 3 * (1 << 20) and t.dtype == torch.float32
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert "hg" in vm_flags(t.data_ptr())


def test_small_or_switched_off_is_ordinary(monkeypatch: pytest.MonkeyPatch) -> None:
    """No advice for a tensor under one huge page, nor with ``KEYSERVE_HUGE_PAGES=0``. (Checked
    on the madvise calls: in a long test process a fresh buffer can land in heap memory an
    earlier, freed huge-page buffer left advised.)"""
    huge_pages.available()  # binds the real madvise, replaced below by a recorder
    calls: list[tuple] = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda *args: calls.append(args) or 0)
    small = huge_pages.empty(1000, torch.float32)
    assert small.numel() == 1000 and not calls
    monkeypatch.setenv("KEYSERVE_HUGE_PAGES", "0")
    assert not huge_pages.available()
    big = huge_pages.empty(1 << 22, torch.float32)
    assert big.numel() == 1 << 22 and not calls
    assert huge_pages.rehome_parameters(torch.nn.Linear(4, 4)) == 0
    monkeypatch.setenv("KEYSERVE_HUGE_PAGES", "1")
    if huge_pages.available():
        t = huge_pages.empty(3 << 20, torch.float32)  # 12 MB: advised, from its aligned start
        assert calls == [(t.data_ptr(), 12 << 20, huge_pages.MADV_HUGEPAGE)]


def test_zeros_are_zero() -> None:
    z = huge_pages.zeros((3, 1 << 20), torch.bfloat16)
    assert z.shape == (3, 1 << 20) and z.dtype == torch.bfloat16
    assert not z.any()


def test_carve_gives_disjoint_aligned_buffers() -> None:
    sizes = [3, 100, 1 << 21, 64, 7]
    bufs = huge_pages.carve(sizes)
    assert [b.numel() for b in bufs] == sizes
    starts = [b.data_ptr() for b in bufs]
    assert all(s % 64 == 0 for s in starts)
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in bufs)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


@needs_thp
def test_rehome_keeps_values_and_ties() -> None:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(4096, 256)  # 4 MB: spans whole huge pages
    head = torch.nn.Linear(256, 4096, bias=False)
    head.weight = emb.weight  # tied, as SmolLM2's LM head is
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "mlp": torch.nn.Linear(256, 512)})
    model.register_buffer("table", torch.arange(10.0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 256)
    out_before = model["head"](x) + model["mlp"](x).sum()
    moved = huge_pages.rehome_parameters(model)
    assert moved >= 4096 * 256 * 4
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model["head"].weight is model["emb"].weight
    assert torch.equal(model["head"](x) + model["mlp"](x).sum(), out_before)
    assert "hg" in vm_flags(model["emb"].weight.data_ptr())
    ptrs = [p.data_ptr() for p in model.parameters()] + [model.table.data_ptr()]
    assert all(p % 64 == 0 for p in ptrs)
    assert max(ptrs) - min(ptrs) < 2 * moved  # one arena


@needs_thp
def test_cpu_kv_cache_is_zeroed_on_advised_pages(stories_path: str) -> None:
    cfg = ModelConfig.from_file(Path(stories_path) / "config.json")
    kv = allocate_kv_cache(cfg, num_blocks=4096, block_size=16, dtype=torch.float32, device="cpu")
    assert len(kv) == cfg.num_hidden_layers
    assert kv[0][0].shape == (4096, 16, cfg.num_key_value_heads, cfg.head_dim)
    assert not any(t.any() for pair in kv for t in pair)
    assert "hg" in vm_flags(kv[-1][1].data_ptr())
