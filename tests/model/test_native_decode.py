"""The one-call native decode step (``kernels/native/decode_stack.c``) against the model's torch
layers on the same weights and the same shuffled paged cache: every layer's K/V as written
into the cache, the final logits of every decode step, greedy text, float32 and bfloat16, one
and several rows, sliding windows, q/k/v biases, KV-budget layouts (per-layer/per-head slots,
per-layer lengths, skipped slots), and the fallback with the native kernels switched off.

Oracle: the torch path (``model._native_decode = None``), itself held to transformers by
test_parity.py -- which runs its decode steps through the native path too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from hf_refs import ours_from_hf, tiny_hf
from helpers.paged_runner import PagedRunner

from keyserve.kernels import native
from keyserve.kernels.native.decode_stack import ROW_LIMITS, NativeDecodeStack
from keyserve.model.llama import LlamaForCausalLM
from keyserve.model.loader import load_model

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: native kernels not built")

TOL = {torch.float32: 2e-5, torch.bfloat16: 0.0}  # bf16: every rounding point is torch's
TOL_AMX = 2**-6  # bf16 on AMX tiles: float32 sums in another order than oneDNN's; two bf16 steps


@pytest.fixture
def native_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts steps the native stack ran (so a test cannot pass on the torch path alone)."""
    calls = [0]
    run = NativeDecodeStack.run

    def counting(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls[0] += 1
        return run(self, *args, **kwargs)

    monkeypatch.setattr(NativeDecodeStack, "run", counting)
    return calls


def _tiny(kind: str, dtype: torch.dtype) -> LlamaForCausalLM:
    if kind == "llama":  # GQA 8/2, llama3 rope scaling, untied head
        return ours_from_hf(tiny_hf("llama"), dtype=dtype)
    if kind == "mistral":  # every layer windowed, window shorter than the sequences
        return ours_from_hf(tiny_hf("mistral", seed=1, sliding_window=12), dtype=dtype)
    if kind == "qwen2":  # q/k/v biases, window on layers 1-2 only, tied head
        hf = tiny_hf("qwen2", seed=2, use_sliding_window=True, sliding_window=10, max_window_layers=1,
                     tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        return ours_from_hf(hf, dtype=dtype)
    raise ValueError(kind)


@dataclasses.dataclass
class _TorchPath:
    model: LlamaForCausalLM

    def __enter__(self) -> None:
        self.stack, self.model._native_decode = self.model._native_decode, None

    def __exit__(self, *exc: object) -> None:
        self.model._native_decode = self.stack


def _seqs(vocab: int, lens: list[int], steps: int) -> dict[int, list[int]]:
    gen = torch.Generator().manual_seed(sum(lens))
    return {i: torch.randint(0, vocab, (n + steps,), generator=gen).tolist() for i, n in enumerate(lens)}


def _steps(runner: PagedRunner, seqs: dict[int, list[int]], lens: list[int]) -> Iterator[tuple]:
    """Prefill every prompt, then decode all sequences together; yields each decode step's
    (input_ids, positions, meta)."""
    runner.step(prefill=[(i, seqs[i][:n]) for i, n in enumerate(lens)])
    for k in range(len(seqs[0]) - lens[0]):
        yield runner.build(decode=[(i, seqs[i][n + k]) for i, n in enumerate(lens)])


def _compare_steps(model: LlamaForCausalLM, lens: list[int], steps: int, block_size: int = 4,
                   num_blocks: int = 64, tol: float | None = None) -> int:
    """Run the same decode steps natively and through torch on two identical caches; compare
    each step's logits and every layer's newly written K/V. Returns the native step count."""
    seqs = _seqs(model.config.vocab_size, lens, steps)
    a = PagedRunner(model, num_blocks=num_blocks, block_size=block_size, seed=3)
    b = PagedRunner(model, num_blocks=num_blocks, block_size=block_size, seed=3)
    tol = TOL[model.dtype] if tol is None else tol
    count = 0
    with torch.inference_mode():
        for (ids, pos, meta), (ids_b, pos_b, meta_b) in zip(_steps(a, seqs, lens), _steps(b, seqs, lens)):
            assert model._native_decode.takes(ids, meta)
            hidden, _ = model(ids, pos, a.kv_caches, meta)
            count += 1
            with _TorchPath(model):
                want, _ = model(ids_b, pos_b, b.kv_caches, meta_b)
            slots = meta.slot_mapping
            for layer, ((ka, va), (kb, vb)) in enumerate(zip(a.kv_caches, b.kv_caches)):
                flat = [c.reshape(-1, *c.shape[2:])[slots] for c in (ka, va, kb, vb)]
                torch.testing.assert_close(flat[0], flat[2], atol=tol, rtol=tol, msg=f"K, layer {layer}")
                torch.testing.assert_close(flat[1], flat[3], atol=tol, rtol=tol, msg=f"V, layer {layer}")
            torch.testing.assert_close(hidden, want, atol=tol, rtol=tol)
            torch.testing.assert_close(model.compute_logits(hidden), model.compute_logits(want),
                                       atol=tol * 10, rtol=tol)
    return count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_tiny_models_layer_by_layer(kind: str, dtype: torch.dtype, native_calls: list[int]) -> None:
    """Three rows of different lengths (windows slide during the run), then one row alone."""
    model = _tiny(kind, dtype)
    assert model._native_decode is not None
    n = _compare_steps(model, [21, 5, 13], steps=10)
    n += _compare_steps(model, [17], steps=6, block_size=8)
    assert native_calls[0] == n == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stories260k_steps_and_greedy(stories_path: str, dtype: torch.dtype, native_calls: list[int]) -> None:
    model = load_model(stories_path, dtype=dtype).model
    _compare_steps(model, [30, 7], steps=8, block_size=16)
    prompt = list(range(1, 25))
    native_out = PagedRunner(model, num_blocks=32, seed=1).greedy_batch({0: prompt, 1: prompt[:9]}, 24)
    with _TorchPath(model):
        calls = native_calls[0]
        torch_out = PagedRunner(model, num_blocks=32, seed=2).greedy_batch({0: prompt, 1: prompt[:9]}, 24)
        assert native_calls[0] == calls  # the oracle really ran torch
    assert native_out == torch_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_limit_and_beyond(dtype: torch.dtype, native_calls: list[int]) -> None:
    """As many rows as the dtype's limit (ROW_LIMITS: 64 in float32, 16 in bf16) run natively --
    enough rows that each row's kv heads are one attention work item; one more goes to torch."""
    model = _tiny("llama", dtype)
    limit = model._native_decode.max_rows
    assert limit == ROW_LIMITS[dtype]
    _compare_steps(model, [3 + i % 20 for i in range(limit)], steps=2, num_blocks=8 * limit)
    assert native_calls[0] == 2
    runner = PagedRunner(model, num_blocks=4 * (limit + 1) + 8, block_size=4)
    runner.step(prefill=[(i, [1, 2, 3]) for i in range(limit + 1)])
    ids, pos, meta = runner.build(decode=[(i, 4) for i in range(limit + 1)])
    assert not model._native_decode.takes(ids, meta)


def test_kv_budget_layouts(native_calls: list[int]) -> None:
    """Per-(layer, head) slots and per-layer lengths (what KV budgets hand the model), with one
    head's slot skipped (< 0), against the torch path given the same metadata."""
    model = _tiny("llama", torch.float32)
    lens, layers, hkv = [9, 14], model.config.num_hidden_layers, model.num_kv_heads
    seqs = _seqs(300, lens, 1)
    runners = [PagedRunner(model, num_blocks=64, block_size=4, seed=5) for _ in range(2)]
    outs, caches = [], []
    for use_native, runner in zip((True, False), runners):
        ids, pos, meta = next(_steps(runner, seqs, lens))
        slots = meta.slot_mapping[None, :, None].repeat(layers, 1, hkv)
        slots[1, 0, 1] = -1  # layer 1, row 0, kv head 1: not written
        ctx = meta.decode_context_lens[None].repeat(layers, 1)
        ctx[2, 1] -= 3  # layer 2 of row 1 attends to fewer slots
        meta = dataclasses.replace(meta, slot_mapping=slots, decode_context_lens=ctx)
        with torch.inference_mode():
            if use_native:
                hidden, _ = model(ids, pos, runner.kv_caches, meta)
            else:
                with _TorchPath(model):
                    hidden, _ = model(ids, pos, runner.kv_caches, meta)
        outs.append(hidden)
        caches.append(torch.stack([torch.stack(kv) for kv in runner.kv_caches]))
    assert native_calls[0] == 1
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(caches[0], caches[1], atol=2e-5, rtol=2e-5)


def test_bad_input_raises_and_writes_nothing() -> None:
    model = _tiny("llama", torch.float32)
    runner = PagedRunner(model, num_blocks=16, block_size=4)
    runner.step(prefill=[(0, [1, 2, 3])])
    before = [k.clone() for k, _ in runner.kv_caches]
    ids, pos, meta = runner.build(decode=[(0, 4)])
    cases = [
        (torch.tensor([300]), pos, meta, "vocabulary"),
        (ids, torch.tensor([512]), meta, "rotary"),
        (ids, pos, dataclasses.replace(meta, slot_mapping=torch.tensor([16 * 4])), "slot"),
        (ids, pos, dataclasses.replace(meta, decode_block_tables=torch.tensor([[99]], dtype=torch.int32)), "block"),
    ]
    with torch.inference_mode():
        for bad_ids, bad_pos, bad_meta, what in cases:
            with pytest.raises(IndexError, match=what):
                model(bad_ids, bad_pos, runner.kv_caches, bad_meta)
    assert all(torch.equal(k, b) for (k, _), b in zip(runner.kv_caches, before))


def test_switched_off_gives_the_same_results(monkeypatch: pytest.MonkeyPatch, stories_path: str) -> None:
    """KEYSERVE_NATIVE_KERNELS=0: no native step, column-major weights, same logits."""
    prompt = list(range(1, 20))
    on = load_model(stories_path).model
    assert on._native_decode is not None
    on_logits = PagedRunner(on, num_blocks=32).teacher_forced({0: prompt}, {0: 12})[0]
    monkeypatch.setenv("KEYSERVE_NATIVE_KERNELS", "0")
    native.library.cache_clear()
    try:
        off = load_model(stories_path).model
        assert off._native_decode is None and native.library() is None
        assert off.model.layers[0].mlp.down_proj.weight.stride() == (1, off.config.hidden_size)
        off_logits = PagedRunner(off, num_blocks=32).teacher_forced({0: prompt}, {0: 12})[0]
    finally:
        monkeypatch.delenv("KEYSERVE_NATIVE_KERNELS")
        native.library.cache_clear()
    torch.testing.assert_close(on_logits, off_logits, atol=2e-5, rtol=2e-5)


def _amx_model(**overrides) -> LlamaForCausalLM:  # noqa: ANN003
    """The tiny llama with an MLP the AMX tiles divide (inputs by 32, outputs by 16)."""
    model = ours_from_hf(tiny_hf("llama", seed=4, intermediate_size=128, **overrides), dtype=torch.bfloat16)
    if model._native_decode._packed is None:
        pytest.skip("no AMX here (CPU, compiler or kernel permission): the bf16 step stops at 16 rows")
    return model


@pytest.mark.parametrize("rows", [17, 40, 64])
def test_bf16_rows_past_16_on_amx_tiles(rows: int, native_calls: list[int]) -> None:
    """Where the CPU has AMX, bf16 steps of 17-64 rows run natively with their products on
    AMX tiles (packed weights): K/V written, hidden states and logits against the torch path
    (whose products are oneDNN's). The sums are float32 in both, in different orders, so a
    value may differ by a bf16 rounding step; every one must be within two."""
    model = _amx_model()
    assert model._native_decode.max_rows == 64
    seqs = [3 + (i * 7) % 29 for i in range(rows)]
    n = _compare_steps(model, seqs, steps=3, num_blocks=8 * rows, tol=TOL_AMX)
    assert native_calls[0] == n == 3


def test_amx_off_switch_keeps_bf16_at_16_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """KEYSERVE_AMX=0: no packed copy, and bf16 keeps the vector kernels' 16-row limit."""
    monkeypatch.setenv("KEYSERVE_AMX", "0")
    model = ours_from_hf(tiny_hf("llama", seed=4, intermediate_size=128), dtype=torch.bfloat16)
    assert model._native_decode._packed is None
    assert model._native_decode.max_rows == ROW_LIMITS[torch.bfloat16] == 16


@pytest.mark.parametrize("rows", [8, 13, 40, 64])
def test_f32_rows_on_register_tiles(rows: int, native_calls: list[int]) -> None:
    """float32 steps of 8-64 rows on an AVX-512 or AVX2 build multiply on f32_block.c's register
    tiles (weights packed 32 outputs to a block): K/V, hidden states and logits against the torch
    path within float32 rounding. 13 rows: a partial second 12-row tile (AVX-512), or tiles of
    5, 4 and 4 rows over each half block (AVX2)."""
    model = ours_from_hf(tiny_hf("llama", seed=4, intermediate_size=128), dtype=torch.float32)
    if model._native_decode._packed is None:
        pytest.skip("no AVX-512 or AVX2 build here: float32 steps keep the row kernel")
    seqs = [3 + (i * 5) % 23 for i in range(rows)]
    n = _compare_steps(model, seqs, steps=2, num_blocks=8 * rows)
    assert native_calls[0] == n == 2


def test_f32_blocks_off_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYSERVE_F32_BLOCKS", "0")
    model = ours_from_hf(tiny_hf("llama", seed=4, intermediate_size=128), dtype=torch.float32)
    assert model._native_decode._packed is None
    assert model._native_decode.max_rows == ROW_LIMITS[torch.float32]
