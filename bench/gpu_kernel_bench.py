"""The Triton kernels on a GPU: achieved memory bandwidth of paged decode, and prefill speed.

Decode attention is memory-bound: each step reads every cached K/V byte of the batch once.
Its floor is (K/V bytes) ÷ (the card's bandwidth), with the bandwidth measured in the same run
(a large device-to-device copy, bytes read + written). For each shape this times, with
``triton.testing.do_bench`` (median, L2 flushed before every call):

- *paged* — ``paged_decode_attention`` as the engine calls it (split-K chosen by the launcher),
- *no split* — the same kernel with flash-decoding forced off,
- *+ H2O scores* — with the per-slot softmax mass the KV policies accumulate,
- *dense SDPA* — ``torch.nn.functional.scaled_dot_product_attention`` over the same tokens held
  contiguously (``[batch, kv_heads, tokens, head_dim]``, GQA), the peer with no paging at all.

Prefill: ``paged_prefill_attention`` over several 2k-token prompts against causal SDPA (flash)
on the same tokens, in TFLOP/s. Block tables are shuffled, as a long-running pool leaves them.

    python bench/gpu_kernel_bench.py [--md docs/BENCHMARKS.md] [--out DIR]

Writes the "kernels_gpu" section of the markdown file and ``bench_kernels_gpu.png`` beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

if "--smoke" in sys.argv:  # before the kernels are decorated: run them through the interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.report import BENCHMARKS_MD, markdown_table, update_section  # noqa: E402
from keyserve.kernels.paged_attention import (  # noqa: E402
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int


SHAPES = (Shape("SmolLM2-135M", 9, 3, 64), Shape("Llama-3-8B", 32, 8, 128))
BLOCK = 16


DEVICE = "cuda"


def timed_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median ms of ``fn``: ``triton.testing.do_bench`` on CUDA (L2 flushed before each call);
    a plain wall-clock loop for the CPU smoke run (``--smoke``), whose numbers mean nothing."""
    if DEVICE == "cuda":
        import triton.testing as tt

        return tt.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    import time

    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[1]


def measure_copy_bandwidth(gib: float = 4.0) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    n = int(gib * (1 << 30)) // 2
    src = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), warmup=50, rep=300)
    del src, dst
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def paged_inputs(batch: int, ctx: int, shape: Shape, dtype: torch.dtype, gen: torch.Generator):
    """A shuffled paged cache holding ``batch`` sequences of ``ctx`` tokens, and the same tokens
    dense (for SDPA)."""
    blocks_per_seq = -(-ctx // BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    kv_shape = (num_blocks, BLOCK, shape.kv_heads, shape.head_dim)
    k_cache = torch.randn(kv_shape, device=DEVICE, dtype=dtype, generator=gen)
    v_cache = torch.randn(kv_shape, device=DEVICE, dtype=dtype, generator=gen)
    perm = torch.randperm(num_blocks - 1, device=DEVICE, generator=gen)
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), ctx, device=DEVICE, dtype=torch.int32)
    query = torch.randn(batch, shape.heads, shape.head_dim, device=DEVICE, dtype=dtype, generator=gen)
    return query, k_cache, v_cache, tables, lens


def dense_from_paged(k_cache: torch.Tensor, tables: torch.Tensor, ctx: int) -> torch.Tensor:
    # k_cache [num_blocks, block, kv_heads, head_dim] -> [batch, kv_heads, ctx, head_dim]
    b = tables.shape[0]
    gathered = k_cache[tables.long()].reshape(b, -1, k_cache.shape[2], k_cache.shape[3])[:, :ctx]
    return gathered.transpose(1, 2).contiguous()


def bench_decode(peak_gbs: float, dtypes: list[torch.dtype], batches: list[int], contexts: list[int],
                 max_kv_gib: float) -> list[dict]:
    rows = []
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    grid = [(s, d, b, c) for s in SHAPES for d in dtypes for b in batches for c in contexts]
    for shape, dtype, batch, ctx in tqdm(grid, desc="decode", unit="shape"):
        elem = torch.finfo(dtype).bits // 8
        kv_bytes = 2 * batch * ctx * shape.kv_heads * shape.head_dim * elem
        if kv_bytes > max_kv_gib * (1 << 30):
            continue
        q, kc, vc, tables, lens = paged_inputs(batch, ctx, shape, dtype, gen)
        scale = shape.head_dim ** -0.5
        kd, vd = dense_from_paged(kc, tables, ctx), dense_from_paged(vc, tables, ctx)
        qd = q.unsqueeze(2)  # [batch, heads, 1, head_dim]

        # Correctness on this very input before timing it.
        out, _ = paged_decode_attention(q, kc, vc, tables, lens, scale)
        ref = torch.cat([  # in float32, a few sequences at a time (a whole 8 GiB batch would not fit)
            F.scaled_dot_product_attention(qd[i:i + 4].float(), kd[i:i + 4].float(), vd[i:i + 4].float(),
                                           scale=scale, enable_gqa=True).squeeze(2)
            for i in range(0, batch, 4)])
        rel = ((out.float() - ref).norm() / ref.norm()).item()

        t_paged = timed_ms(lambda: paged_decode_attention(q, kc, vc, tables, lens, scale))
        t_nosplit = timed_ms(lambda: paged_decode_attention(q, kc, vc, tables, lens, scale, split_k=False))
        t_scores = timed_ms(lambda: paged_decode_attention(q, kc, vc, tables, lens, scale, score_mode="softmax"))
        t_dense = timed_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True))
        gbs = kv_bytes / (t_paged * 1e-3) / 1e9
        rows.append(dict(
            model=shape.name, dtype=str(dtype).replace("torch.", ""), batch=batch, context=ctx,
            kv_mib=kv_bytes / (1 << 20), paged_us=t_paged * 1e3, nosplit_us=t_nosplit * 1e3,
            scores_us=t_scores * 1e3, dense_us=t_dense * 1e3, paged_gbs=gbs,
            frac_of_peak=gbs / peak_gbs, dense_gbs=kv_bytes / (t_dense * 1e-3) / 1e9,
            rel_err=rel,
        ))
        del q, kc, vc, tables, lens, kd, vd, qd
        torch.cuda.empty_cache()
    return rows


def bench_prefill(dtype: torch.dtype, num_seqs: int, prompt: int) -> list[dict]:
    rows = []
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for shape in SHAPES:
        _, kc, vc, tables, _ = paged_inputs(num_seqs, prompt, shape, dtype, gen)
        q = torch.randn(num_seqs * prompt, shape.heads, shape.head_dim, device=DEVICE, dtype=dtype,
                        generator=gen)
        qsl = torch.arange(0, num_seqs + 1, device=DEVICE, dtype=torch.int32) * prompt
        lens = torch.full((num_seqs,), prompt, device=DEVICE, dtype=torch.int32)
        scale = shape.head_dim ** -0.5
        kd, vd = dense_from_paged(kc, tables, prompt), dense_from_paged(vc, tables, prompt)
        qd = q.view(num_seqs, prompt, shape.heads, shape.head_dim).transpose(1, 2).contiguous()
        out, _ = paged_prefill_attention(q, kc, vc, tables, qsl, lens, scale)
        ref = F.scaled_dot_product_attention(qd.float(), kd.float(), vd.float(), scale=scale,
                                             is_causal=True, enable_gqa=True)
        ref = ref.transpose(1, 2).reshape_as(out)
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        t_paged = timed_ms(lambda: paged_prefill_attention(q, kc, vc, tables, qsl, lens, scale))
        t_dense = timed_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, is_causal=True,
                                                                  enable_gqa=True))
        # Causal attention: QK^T and PV over the lower triangle, 2 FLOPs per multiply-add.
        flops = 4 * num_seqs * shape.heads * shape.head_dim * prompt * (prompt + 1) / 2
        key = torch.randn(num_seqs * prompt, shape.kv_heads, shape.head_dim, device=DEVICE, dtype=dtype,
                          generator=gen)
        slots = (tables.long()[:, :, None] * BLOCK + torch.arange(BLOCK, device=DEVICE)).reshape(num_seqs, -1)
        slots = slots[:, :prompt].reshape(-1)
        t_write = timed_ms(lambda: write_kv(key, key, kc, vc, slots))
        rows.append(dict(
            model=shape.name, dtype=str(dtype).replace("torch.", ""), seqs=num_seqs, prompt=prompt,
            paged_ms=t_paged, dense_ms=t_dense, paged_tflops=flops / (t_paged * 1e-3) / 1e12,
            dense_tflops=flops / (t_dense * 1e-3) / 1e12, rel_err=rel, write_kv_us=t_write * 1e3,
            write_kv_gbs=4 * key.numel() * key.element_size() / (t_write * 1e-3) / 1e9,
        ))
        del kc, vc, q, kd, vd, qd, key
        torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, model in zip(axes, [s.name for s in SHAPES]):
        for (dtype, batch) in sorted({(r["dtype"], r["batch"]) for r in rows if r["model"] == model}):
            pts = [r for r in rows if r["model"] == model and r["dtype"] == dtype and r["batch"] == batch]
            ax.plot([r["context"] for r in pts], [100 * r["frac_of_peak"] for r in pts], marker="o",
                    label=f"{dtype} batch {batch}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"paged decode, {model} heads")
        ax.set_xlabel("context tokens")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("% of measured copy bandwidth")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render(result: dict) -> str:
    dec, pre = result["decode"], result["prefill"]
    peak = result["peak_gbs"]
    best = max(dec, key=lambda r: r["frac_of_peak"])
    big = [r for r in dec if r["kv_mib"] >= 256]
    lines = [
        f"GPU: {result['gpu']}; Triton {result['triton']}. Copy bandwidth measured in this run "
        f"(4 GiB device-to-device, bytes read + written): **{peak:.0f} GB/s**. Times are medians of "
        "`triton.testing.do_bench` (L2 flushed before each call); block size 16, block tables "
        "shuffled. *GB/s* counts the K/V bytes a step must read (batch × context × kv heads × "
        "head_dim × 2 × dtype size); *rel err* is ‖paged − SDPA(float32)‖ / ‖SDPA(float32)‖ on the "
        "same input.",
        "",
        "### Decode attention (one layer, one step)",
        "",
        markdown_table(
            ["model heads", "dtype", "batch", "context", "K/V MiB", "paged µs", "no split µs",
             "+ H2O scores µs", "dense SDPA µs", "paged GB/s", "% of copy BW", "paged / SDPA",
             "rel err"],
            [[r["model"], r["dtype"], r["batch"], r["context"], round(r["kv_mib"], 1),
              round(r["paged_us"], 1), round(r["nosplit_us"], 1), round(r["scores_us"], 1),
              round(r["dense_us"], 1), round(r["paged_gbs"]), f"{100 * r['frac_of_peak']:.0f}%",
              f"{r['paged_us'] / r['dense_us']:.2f}×", f"{r['rel_err']:.1e}"] for r in dec],
        ),
        "",
        f"Best: {100 * best['frac_of_peak']:.0f}% of the copy bandwidth ({best['model']}, "
        f"{best['dtype']}, batch {best['batch']}, context {best['context']}). Over the shapes "
        f"that read ≥ 256 MiB of K/V, the paged kernel reaches "
        f"{100 * min(r['frac_of_peak'] for r in big):.0f}–{100 * max(r['frac_of_peak'] for r in big):.0f}% "
        "of it." if big else "",
        "",
        "### Prefill attention and KV write",
        "",
        markdown_table(
            ["model heads", "dtype", "sequences × prompt", "paged ms", "causal SDPA ms",
             "paged TFLOP/s", "SDPA TFLOP/s", "paged / SDPA", "rel err", "write_kv µs",
             "write_kv GB/s"],
            [[r["model"], r["dtype"], f"{r['seqs']} × {r['prompt']}", round(r["paged_ms"], 3),
              round(r["dense_ms"], 3), round(r["paged_tflops"], 1), round(r["dense_tflops"], 1),
              f"{r['paged_ms'] / r['dense_ms']:.2f}×", f"{r['rel_err']:.1e}",
              round(r["write_kv_us"], 1), round(r["write_kv_gbs"])] for r in pre],
        ),
        "",
        "![GPU decode bandwidth](bench_kernels_gpu.png)",
    ]
    return "\n".join(lines)


def smoke(args: argparse.Namespace) -> None:
    """Every code path at tiny sizes on the CPU (the Triton kernels through the interpreter)."""
    global SHAPES
    SHAPES = (Shape("tiny-gqa3", 6, 2, 16), Shape("tiny-gqa4", 8, 2, 32))
    result = dict(gpu="CPU smoke run (TRITON_INTERPRET=1)", triton="interpreter",
                  peak_gbs=measure_copy_bandwidth(0.01))
    result["decode"] = bench_decode(result["peak_gbs"], [torch.bfloat16, torch.float32], [1, 2], [40, 600], 1.0)
    result["prefill"] = bench_prefill(torch.bfloat16, 2, 40)
    bad = [r for r in result["decode"] + result["prefill"] if not r["rel_err"] < 2e-2]
    print(render(result))
    if bad:
        sys.exit(f"smoke: kernels disagree with SDPA: {bad}")
    print("smoke: every path ran and matched SDPA")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--md", type=Path, default=BENCHMARKS_MD, help="markdown file to update")
    ap.add_argument("--out", type=Path, default=None, help="also write the raw JSON here")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    ap.add_argument("--max-kv-gib", type=float, default=8.0)
    ap.add_argument("--render", type=Path, default=None, help="re-render a saved JSON, no GPU")
    ap.add_argument("--smoke", action="store_true",
                    help="run every code path on the CPU under TRITON_INTERPRET=1 at tiny sizes "
                         "(checks the script, measures nothing; writes nothing unless --md is given)")
    args = ap.parse_args()
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
        return smoke(args)
    if args.render:
        result = json.loads(args.render.read_text())
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_kernel_bench needs a CUDA GPU")
        import triton

        peak = measure_copy_bandwidth()
        result = dict(
            gpu=torch.cuda.get_device_name(0), triton=triton.__version__, peak_gbs=peak,
            decode=bench_decode(peak, [torch.bfloat16, torch.float32], args.batches, args.contexts,
                                args.max_kv_gib),
            prefill=bench_prefill(torch.bfloat16, 4, 2048),
        )
        plot(result["decode"], args.md.parent / "bench_kernels_gpu.png")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_kernels_gpu.json").write_text(json.dumps(result, indent=1))
    body = render(result)
    print(body)
    update_section("kernels_gpu", "Kernels on a GPU: Triton paged decode bandwidth and prefill", body,
                   path=args.md)


if __name__ == "__main__":
    main()
