"""Tree attention masks of decode rows (``AttentionMetadata.decode_tree_masks``) in every
decode implementation.

With L a row's context length, bit i (0 <= i <= 62) of its int64 mask shows slot L-1-i (bit 0:
the row's own token), older slots are always visible, bit 63 is ignored, -1 shows everything;
hidden slots leave the softmax as if absent (scores 0). The tests:

1. ``test_reference_equals_hand_gathered_oracle``: the reference (its SDPA path and its
   explicit-logits score path) against float64 dense softmax over each row's visible slots,
   gathered by hand from the true per-sequence K/V (``paged_cases``), scores included.
2. ``test_native_equals_reference``: the native C kernel against the reference, float32 and
   bfloat16 caches, windows, score modes None / softmax / gumbel (same noise keys), both work
   splits; hidden slots' scores exactly 0.
3. ``test_triton_equals_reference``: the Triton kernel (interpreted on the CPU), single-pass and
   split-K, the same modes.
4. ``test_tree_step_equals_sequential_paths``: a whole tree verification step of a tiny model,
   on the native decode stack and on the per-layer path, against decoding each tree path as a
   plain sequence (the oracle: a node must see exactly its path); and the two paths against
   each other. ``test_attention_entry_passes_masks_with_scores`` for ``attention.py``'s
   score route, ``test_cuda_graphs_refuse_masks`` for the graphs.
5. ``test_all_visible_masks_are_bit_identical``: masks of -1 against no masks, every
   implementation (and the decode stack), bit for bit.

Mutations made by hand (each then reverted) and the tests that failed on them:
- C kernel ignores the mask (ks_attend's masking skipped): 2 and 4 (the native stack and the
  per-layer path both leave the sequential oracle).
- C hides slot lo+i for bit i instead of slot len-1-i: 2 and 4.
- C mask reaching 64 slots (bit 63 honoured, the >= 63 rule broken): 2.
- The decode stack passes -1 instead of the row's mask: 4.
- Triton reads bit t (the slot index) instead of bit L-1-t: 3.
- Triton forgets the >= 63 rule (older slots then read the clamped bit 63): 3.
- The reference forgets the >= 63 rule (``cpu_paths.tree_visible``): 1.
- ``decode_sdpa`` ignores the mask: 1 (the SDPA path).
- ``attention._with_scores`` drops the masks on its plain/softmax route: the attention-entry test.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from paged_cases import PagedCase, make_case, tolerance

from keyserve.kernels import attention, native
from keyserve.kernels.metadata import AttentionMetadata
from keyserve.kernels.native.decode import paged_decode_attention_native
from keyserve.kernels.reference import paged_decode_attention_reference

BITS = 63  # slots a mask covers
SCORE_TOL = {"atol": 1e-5, "rtol": 1e-5}
native_only = pytest.mark.skipif(native.library() is None, reason="no C compiler: native kernels not built")

# Rows of the kernel cases: (context length, mask kind). Contexts shorter and longer than 63
# slots, exactly 63/64, an empty row; masks: all visible, only itself, random (bit 0 set),
# random (bit 0 maybe clear), nothing of the last 63 (a row of <= 63 slots then sees nothing).
ROWS = [(70, "random"), (0, "random"), (1, "self"), (5, "random"), (40, "random0"), (63, "random"),
        (64, "self"), (65, "all"), (130, "random"), (20, "none"), (100, "none"), (33, "random0")]


def _mask(kind: str, rng: random.Random) -> int:
    """A signed int64 mask of ``kind`` (random ones include bit 63, which must be ignored)."""
    if kind == "all":
        return -1
    if kind == "self":
        return 1
    if kind == "none":
        return 0
    bits = rng.getrandbits(64) | (1 if kind == "random" else 0)
    return bits - (1 << 64) if bits >> 63 else bits


def _rows(rows: list[tuple[int, str]], seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return [n for n, _ in rows], [_mask(kind, rng) for _, kind in rows]


def _visible(ctx: int, mask: int, window: int | None) -> list[int]:
    """The slots a row sees, straight from the definition (Python ints)."""
    lo = 0 if window is None else max(0, ctx - window)
    return [t for t in range(lo, ctx) if ctx - 1 - t >= BITS or (mask >> (ctx - 1 - t)) & 1]


def _oracle(case: PagedCase, q: torch.Tensor, scale: float, masks: list[int], window: int | None,
            score_mode: str | None = None, tau: torch.Tensor | None = None,
            uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 dense attention of each row over its visible slots only, K/V gathered by hand
    from the true per-sequence tokens: (out [S, H, D], scores [S, Hkv, max_ctx])."""
    num_seqs, num_heads, head_dim = q.shape
    group = num_heads // case.k_cache.shape[2]
    lens = case.context_lens.tolist()
    out = torch.zeros(num_seqs, num_heads, head_dim, dtype=torch.float64)
    scores = torch.zeros(num_seqs, case.k_cache.shape[2], max(lens), dtype=torch.float64)
    for i, n in enumerate(lens):
        vis = _visible(n, masks[i], window)
        if not vis:
            continue
        k, v = case.keys[i][vis].double(), case.values[i][vis].double()
        for h in range(num_heads):
            x = k[:, h // group] @ q[i, h].double() * scale
            p = torch.softmax(x, dim=0)
            out[i, h] = p @ v[:, h // group]
            if score_mode == "gumbel":
                u = uniforms[i, h, vis].double().clamp(1e-20, 1 - 1e-7)
                p = torch.softmax((x - torch.log(-torch.log(u))) / float(tau[i]), dim=0)
            scores[i, h // group, vis] += p
    return out, scores


def _hidden(lens: list[int], masks: list[int], window: int | None) -> torch.Tensor:
    """[S, max_ctx] bool: slots of a row's context it does not see."""
    hidden = torch.zeros(len(lens), max(lens), dtype=torch.bool)
    for i, n in enumerate(lens):
        hidden[i, :n] = True
        hidden[i, _visible(n, masks[i], window)] = False
    return hidden


def _case(rows: list[tuple[int, str]], block_size: int, hkv: int, group: int, head_dim: int,
          dtype: torch.dtype, seed: int):
    lens, masks = _rows(rows, seed)
    case = make_case(lens, block_size, hkv, head_dim, dtype, seed=seed)
    q = torch.randn(len(lens), hkv * group, head_dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return case, q, masks, torch.tensor(masks, dtype=torch.int64)


def _args(case: PagedCase, q: torch.Tensor, scale: float) -> tuple:
    return (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, scale)


# ------------------------------------------------------------------------------ 1. reference


@pytest.mark.parametrize("score_mode", [None, "softmax", "gumbel"])
@pytest.mark.parametrize(
    "block_size,head_dim,hkv,group,dtype,window",
    [(16, 64, 3, 3, torch.float32, None), (8, 32, 2, 4, torch.float32, 50),
     (16, 16, 1, 8, torch.bfloat16, None), (4, 8, 4, 2, torch.float32, 7)],
)
def test_reference_equals_hand_gathered_oracle(block_size, head_dim, hkv, group, dtype, window, score_mode):
    case, q, masks, tm = _case(ROWS, block_size, hkv, group, head_dim, dtype, seed=head_dim + block_size)
    scale = head_dim**-0.5
    n = len(ROWS)
    tau = torch.linspace(0.5, 2.0, n)
    u = torch.rand(n, hkv * group, case.context_lens.max(), generator=torch.Generator().manual_seed(2))
    out, scores = paged_decode_attention_reference(
        *_args(case, q, scale), window, score_mode=score_mode, tau=tau, uniforms=u, tree_masks=tm)
    want_out, want_scores = _oracle(case, q, scale, masks, window, score_mode, tau, u)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want_out.to(dtype).double(), **tolerance(dtype))
    if score_mode is None:
        assert scores is None
    else:
        torch.testing.assert_close(scores.double(), want_scores, **SCORE_TOL)
        assert torch.all(scores.permute(0, 2, 1)[_hidden(case.context_lens.tolist(), masks, window)] == 0)


# ------------------------------------------------------------------------------ 2. native


@native_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("score_mode", [None, "softmax", "gumbel"])
@pytest.mark.parametrize("num_rows,head_dim", [(12, 64), (3, 64), (12, 16)])
def test_native_equals_reference(dtype, window, score_mode, num_rows, head_dim):
    """12 rows on 2 threads: a row's kv heads are one work item; 3 rows: one item per kv head.
    head_dim 16 takes attend.h's scalar loops."""
    case, q, masks, tm = _case(ROWS[:num_rows], 16, 3, 3, head_dim, dtype, seed=num_rows + head_dim)
    n, scale = len(masks), head_dim**-0.5
    tau = torch.linspace(0.5, 2.0, n)
    keys = torch.stack([torch.arange(n) * 7 + 1, torch.arange(n) + 90], dim=1)
    kw = dict(tau=tau, noise_keys=keys, noise_layer=5, tree_masks=tm)
    # the explicit-logits path (float32 math) is the oracle for every mode
    want_out, want_scores = paged_decode_attention_reference(
        *_args(case, q, scale), window, score_mode=score_mode or "softmax", **kw)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, scores = paged_decode_attention_native(*_args(case, q, scale), window, score_mode=score_mode, **kw)
    finally:
        torch.set_num_threads(threads)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output is rounded once
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    if score_mode is None:
        assert scores is None
        return
    torch.testing.assert_close(scores, want_scores, **SCORE_TOL)
    hidden = _hidden(case.context_lens.tolist(), masks, window)
    assert torch.all(scores.permute(0, 2, 1)[hidden] == 0)  # exactly: weight 0, not tiny


# ------------------------------------------------------------------------------ 3. Triton

TRITON_ROWS = [(70, "random"), (0, "random"), (1, "self"), (20, "random0"), (64, "self"), (40, "all"),
               (66, "random"), (10, "none")]


@pytest.mark.parametrize(
    "score_mode,split_k,window,dtype",
    [(None, False, None, torch.float32), (None, True, 30, torch.float32), ("softmax", False, 30, torch.float32),
     ("softmax", True, None, torch.float32), ("gumbel", False, None, torch.float32),
     ("gumbel", True, 30, torch.float32), (None, True, None, torch.bfloat16)],
)
def test_triton_equals_reference(triton_kernels, score_mode, split_k, window, dtype):
    """Split-K with 16-slot partitions: a row's last 63 slots span several partitions."""
    pytest.importorskip("triton")
    case, q, masks, tm = _case(TRITON_ROWS, 8, 2, 2, 16, dtype, seed=11)
    n, scale = len(masks), 0.25
    tau = torch.linspace(0.5, 2.0, n)
    keys = torch.stack([torch.arange(n) * 3 + 5, torch.arange(n) + 17], dim=1)
    kw = dict(tau=tau, noise_keys=keys, noise_layer=3, tree_masks=tm)
    out, scores = triton_kernels.paged_decode_attention(
        *_args(case, q, scale), window, score_mode=score_mode, split_k=split_k, partition_size=16, **kw)
    want_out, want_scores = paged_decode_attention_reference(
        *_args(case, q, scale), window, score_mode=score_mode or "softmax", **kw)
    torch.testing.assert_close(out, want_out.to(dtype), **tolerance(dtype))
    if score_mode is None:
        assert scores is None
        return
    torch.testing.assert_close(scores, want_scores, atol=2e-5, rtol=1e-4)
    assert torch.all(scores.permute(0, 2, 1)[_hidden(case.context_lens.tolist(), masks, window)] == 0)


# ------------------------------------------------------------------------------ 5. -1 == None


def _decode_impls(triton_kernels) -> dict:
    impls = {"reference": paged_decode_attention_reference}
    if native.library() is not None:
        impls["native"] = paged_decode_attention_native
    for split in (False, True):
        def run(*a, _split=split, **kw):
            return triton_kernels.paged_decode_attention(*a, split_k=_split, partition_size=16, **kw)
        impls[f"triton-split{int(split)}"] = run
    return impls


@pytest.mark.parametrize("score_mode", [None, "softmax", "gumbel"])
def test_all_visible_masks_are_bit_identical(triton_kernels, score_mode):
    """Equal lengths too (the reference's SDPA path slices instead of masking them)."""
    pytest.importorskip("triton")
    for lens in ([3, 70, 64, 9], [40, 40, 40]):
        case = make_case(lens, 8, 2, 16, seed=len(lens))
        q = torch.randn(len(lens), 4, 16, generator=torch.Generator().manual_seed(4))
        kw = dict(score_mode=score_mode, tau=torch.ones(len(lens)),
                  noise_keys=torch.arange(2 * len(lens)).view(-1, 2))
        all_visible = torch.full((len(lens),), -1, dtype=torch.int64)
        for name, fn in _decode_impls(triton_kernels).items():
            out, scores = fn(*_args(case, q, 0.25), 30, **kw)
            out_m, scores_m = fn(*_args(case, q, 0.25), 30, tree_masks=all_visible, **kw)
            assert torch.equal(out, out_m), name
            assert (scores is None and scores_m is None) or torch.equal(scores, scores_m), name


# ------------------------------------------------------------------------------ 4. model path


def _tree_masks(parents: list[int]) -> list[int]:
    """Masks of rows 0..N packed in preorder (parents[r] < r, -1 for the root at row 0): row r
    sees the prefix, its ancestors and itself (bit r - a for row a)."""
    masks = []
    for r in range(len(parents)):
        mask = -1 << (r + 1)  # the prefix before the root
        a = r
        while a >= 0:
            mask |= 1 << (r - a)
            a = parents[a]
        masks.append(mask)
    return masks


def _depth(parents: list[int], r: int) -> int:
    return 0 if parents[r] < 0 else 1 + _depth(parents, parents[r])


def _path(parents: list[int], r: int) -> list[int]:
    return ([] if parents[r] < 0 else _path(parents, parents[r])) + [r]


def _tree_step(runner, seq_id: int, tokens: list[int], parents: list[int], masks: list[int] | None):
    """One verification step of a tree after ``seq_id``'s cached prefix: row r is node r at
    slot P + r (preorder), position P + depth, context P + r + 1, with its mask."""
    start = runner.lengths[seq_id]
    n = len(tokens)
    table = runner._grow(seq_id, start + n)
    runner.lengths[seq_id] = start + n
    width = len(table)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(runner._slots(table, start, start + n), dtype=torch.int64),
        num_decode_seqs=n,
        decode_block_tables=torch.tensor([table] * n, dtype=torch.int32).view(n, width),
        decode_context_lens=torch.arange(start + 1, start + n + 1, dtype=torch.int32),
        prefill_block_tables=torch.zeros(0, width, dtype=torch.int32),
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
        prefill_context_lens=torch.zeros(0, dtype=torch.int32),
        decode_tree_masks=None if masks is None else torch.tensor(masks, dtype=torch.int64),
    )
    positions = torch.tensor([start + _depth(parents, r) for r in range(n)], dtype=torch.int64)
    return torch.tensor(tokens, dtype=torch.int64), positions, meta


@native_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_step_equals_sequential_paths(dtype, monkeypatch):
    """A 7-node tree after a 70-token prompt (so the masks' 63-slot reach ends inside the
    prompt), run as one step of decode rows: on the native decode stack, and on the per-layer
    path (attention.py -> the native paged kernel), every node's logits equal those of its path
    decoded token by token as a plain sequence; the two paths agree with each other; masks of
    -1 on a chain step equal no masks bit for bit on the stack."""
    pytest.importorskip("transformers")
    from helpers.paged_runner import PagedRunner
    from model.hf_refs import ours_from_hf, tiny_hf

    from keyserve.kernels.native.decode_stack import NativeDecodeStack

    model = ours_from_hf(tiny_hf("llama"), dtype=dtype)
    assert model._native_decode is not None
    calls = [0]
    run = NativeDecodeStack.run

    def counting(self, *a, **kw):
        calls[0] += 1
        return run(self, *a, **kw)

    monkeypatch.setattr(NativeDecodeStack, "run", counting)
    prompt = [(7 * i + 3) % 300 for i in range(70)]
    parents = [-1, 0, 1, 0, 3, 3, 1]  # root; two branches; node 6 hangs off node 1 after both
    tokens = [11, 22, 33, 44, 55, 66, 77]
    masks = _tree_masks(parents)
    logits = {}
    with torch.inference_mode():
        for stack in (True, False):
            runner = PagedRunner(model, num_blocks=64, block_size=16, seed=1)
            runner.step(prefill=[(0, prompt)])
            ids, pos, meta = _tree_step(runner, 0, tokens, parents, masks)
            assert model._native_decode.takes(ids, meta)
            saved = model._native_decode
            if not stack:
                model._native_decode = None
            try:
                before = calls[0]
                hidden, _ = model(ids, pos, runner.kv_caches, meta)
                assert calls[0] == before + int(stack)
            finally:
                model._native_decode = saved
            logits[stack] = model.compute_logits(hidden)
        # the oracle: each node's path as a plain sequence (one per node, decoded together)
        runner = PagedRunner(model, num_blocks=128, block_size=16, seed=2)
        paths = [[tokens[a] for a in _path(parents, r)] for r in range(len(tokens))]
        want = runner.teacher_forced({r: prompt + p for r, p in enumerate(paths)},
                                     {r: len(prompt) for r in range(len(paths))})
    want = torch.stack([want[r][-1] for r in range(len(tokens))])
    # Here they agree bit for bit (a hidden slot adds exactly 0); the tolerance is a bf16 step
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for stack in (True, False):
        torch.testing.assert_close(logits[stack], want, atol=tol, rtol=0, msg=f"stack={stack}")
    torch.testing.assert_close(logits[True], logits[False], atol=tol, rtol=0)
    # without masks the step is far outside that tolerance (~0.056): the masks are what is tested
    assert _unmasked_gap(model, prompt, tokens, parents, want) > 4 * tol

    # -1 masks on the stack: the same bits as no masks
    outs = []
    for m in (None, [-1] * 4):
        runner = PagedRunner(model, num_blocks=64, block_size=16, seed=1)
        runner.step(prefill=[(0, prompt)])
        with torch.inference_mode():
            ids, pos, meta = _tree_step(runner, 0, tokens[:4], [-1, 0, 1, 2], m)
            outs.append(model(ids, pos, runner.kv_caches, meta)[0])
    assert torch.equal(outs[0], outs[1])


def _unmasked_gap(model, prompt: list[int], tokens: list[int], parents: list[int], want: torch.Tensor) -> float:
    """How far the tree step's logits are from the oracle without masks (every node seeing
    every earlier node): the masks must matter for this test to mean anything."""
    from helpers.paged_runner import PagedRunner

    runner = PagedRunner(model, num_blocks=64, block_size=16, seed=1)
    with torch.inference_mode():
        runner.step(prefill=[(0, prompt)])
        ids, pos, meta = _tree_step(runner, 0, tokens, parents, None)
        hidden, _ = model(ids, pos, runner.kv_caches, meta)
    return float((model.compute_logits(hidden) - want).abs().max())


@pytest.mark.parametrize("score_mode", ["softmax", "gumbel", "mixed"])
def test_attention_entry_passes_masks_with_scores(score_mode):
    """``attention.paged_attention`` hands the meta's masks to the decode kernel on every route,
    the score ones included (the reference given the same masks is the oracle)."""
    rows = ROWS[:6]
    case, q, masks, tm = _case(rows, 16, 2, 2, 64, torch.float32, seed=9)
    n = len(rows)
    empty = torch.zeros(n, 2, 64)
    meta = AttentionMetadata(
        slot_mapping=torch.full((n,), -1, dtype=torch.int64), num_decode_seqs=n,
        decode_block_tables=case.block_tables, decode_context_lens=case.context_lens,
        prefill_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
        prefill_context_lens=torch.zeros(0, dtype=torch.int32),
        score_mode=score_mode, gumbel_rows=torch.arange(n) % 2 == 0, tau=torch.linspace(0.5, 2, n),
        noise_keys=torch.arange(2 * n).view(n, 2), decode_tree_masks=tm,
    )
    out, (scores, _) = attention.paged_attention(0, q, empty, empty, case.k_cache, case.v_cache, meta, 0.125)
    mode = "gumbel" if score_mode == "gumbel" else "softmax"
    kw = dict(tau=meta.tau, noise_keys=meta.noise_keys, noise_layer=0, tree_masks=tm)
    want_out, want = paged_decode_attention_reference(*_args(case, q, 0.125), score_mode=mode, **kw)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    if score_mode != "mixed":
        torch.testing.assert_close(scores, want, **SCORE_TOL)
    assert torch.all(scores.permute(0, 2, 1)[_hidden(case.context_lens.tolist(), masks, None)] == 0)


def test_cuda_graphs_refuse_masks():
    """The captured graphs have no buffer for masks: a tree step runs eagerly."""
    from keyserve.engine.cuda_graphs import graphable

    meta = AttentionMetadata(
        slot_mapping=torch.zeros(2, dtype=torch.int64), num_decode_seqs=2,
        decode_block_tables=torch.zeros(2, 1, dtype=torch.int32),
        decode_context_lens=torch.ones(2, dtype=torch.int32),
        prefill_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
        prefill_context_lens=torch.zeros(0, dtype=torch.int32),
    )
    assert graphable(meta, 2, 4)
    assert not graphable(dataclasses.replace(meta, decode_tree_masks=torch.tensor([-1, 1])), 2, 4)


def test_bad_masks_are_refused():
    case, q, _, tm = _case(ROWS[:3], 16, 1, 2, 16, torch.float32, seed=1)
    for bad, what in ((tm.int(), "dtype"), (tm[:2], "entries"), (tm[:, None], "dims")):
        with pytest.raises(ValueError, match=what):
            paged_decode_attention_reference(*_args(case, q, 0.25), tree_masks=bad)
        if native.library() is not None:
            with pytest.raises(ValueError, match=what):
                paged_decode_attention_native(*_args(case, q, 0.25), tree_masks=bad)


# The compiled kernel (not the interpreter) with masks: aot_compile.py's recorder and
# compiler, on launches that pass tree masks (single-pass and split-K, both tile paths, scores).
_AOT_TREE = """
import sys
import torch
import aot_compile as aot  # drops TRITON_INTERPRET before triton is imported
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction
from paged_cases import make_case
from keyserve.kernels import checks, paged_attention as pa

calls = []
JITFunction.__getitem__ = lambda self, grid: (lambda *a, **c: calls.append((self, a, c)))
checks.check_device = lambda name, t: None
for dtype, d in ((torch.bfloat16, 64), (torch.float32, 8)):
    case = make_case([3, 70], 16, 2, d, dtype)
    q = torch.randn(2, 8, d).to(dtype)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.1)
    masks = torch.tensor([-1, 5], dtype=torch.int64)
    pa.paged_decode_attention(*args, tree_masks=masks)
    pa.paged_decode_attention(*args, sliding_window=8, score_mode="gumbel", tau=torch.ones(2),
                              split_k=True, partition_size=16, tree_masks=masks)
failures = 0
for fn, a, c in calls:
    if "HAS_TREE" in c and not c["HAS_TREE"]:
        continue
    try:
        src = triton.compiler.ASTSource(fn, aot.signature(fn, a, c), c)
        assert triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm.get("cubin")
        print("ok  ", fn.__name__, flush=True)
    except Exception as e:
        failures += 1
        print("FAIL", fn.__name__, repr(e)[:3000], flush=True)
sys.exit(1 if failures else 0)
"""


def test_masked_decode_compiles_for_sm90():
    """The HAS_TREE kernels through ptxas for sm_90 (what the interpreter forgives: int64
    shifts, a constexpr branch defining the mask), as test_triton_compiles_for_gpu.py does for
    the others."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton build ships no NVIDIA ptxas")
    here = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parents[1] / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _AOT_TREE], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count("ok   _decode_kernel") == 4, proc.stdout
