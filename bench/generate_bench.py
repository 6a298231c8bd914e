"""Foundation benchmark: keyserve vs transformers on SmolLM2-135M-Instruct, on this machine.

1. batch-1 decode tokens/s, and as a fraction of the memory-bandwidth bound (bandwidth measured
   in the same run ÷ bytes of weights read per token);
2. throughput of 64 requests (prompts 50–1000 tokens, outputs 16–256): keyserve's continuous
   batching vs transformers' padded ``generate`` (batches of 16) and its continuous batching
   (``generate_batch``'s manager), and as a fraction of the compute bound (matmul FLOP/s measured
   in the same run). transformers gets what keyserve gets: the time it needs (or ``--hf-budget``
   seconds), counted from when its model is loaded; one stopped by a budget is reported with the
   requests and tokens it finished.

    python bench/generate_bench.py [--dtypes float32 bfloat16] [--num-requests 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.peers import hf_many  # noqa: E402
from bench.peers.results import useful_tok_s  # noqa: E402
from bench.report import markdown_table, update_section  # noqa: E402
from bench.workloads import mixed_requests  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CHAT_PROMPT = "Write a short story about a robot who learns to paint."


def measure_bandwidth_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """Read bandwidth: the best of a few full reductions over a buffer far larger than cache."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def measure_matmul_gflops(dtype: torch.dtype, repeats: int = 5) -> float:
    """Dense matmul throughput at the model's shapes (2048 tokens × hidden 576 × 1536)."""
    a = torch.randn(2048, 576, dtype=dtype)
    b = torch.randn(576, 1536, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        best = min(best, (time.perf_counter() - t) / 10)
    return 2 * 2048 * 576 * 1536 / best / 1e9


def weight_bytes_per_token(model: torch.nn.Module, tied: bool, vocab: int, hidden: int) -> int:
    """Bytes of weights one decode step reads: every matrix once; an untied input embedding
    contributes only its one row."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not tied:
        emb = next(p for n, p in model.named_parameters() if "embed" in n)
        total -= emb.numel() * emb.element_size() - hidden * emb.element_size()
    return total


def flops_per_token(num_params_matmul: int) -> int:
    return 2 * num_params_matmul


# ------------------------------------------------------------------------ keyserve
def keyserve_decode(llm, max_tokens: int) -> float:
    from keyserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # warm-up (EOS ignored: it always reaches a decode step, which records a CUDA graph on a GPU)
    llm.generate(CHAT_PROMPT, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), chat=True)
    llm.engine.block_manager.reset_prefix_cache()
    [out] = llm.generate(CHAT_PROMPT, params, chat=True)
    return out.stats.tokens_per_s


def keyserve_throughput(llm, requests) -> tuple[float, float, int]:
    from keyserve import SamplingParams

    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
    llm.engine.block_manager.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=True)
    elapsed = time.perf_counter() - t
    generated = sum(len(o.token_ids) for o in outs)
    return generated / elapsed, elapsed, generated


# -------------------------------------------------------------------- transformers
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_decode(model, tokenizer, max_tokens: int) -> float:
    """transformers' batch-1 decode tok/s on the model's own device (CPU or CUDA)."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"].to(model.device)

    def run(n: int) -> float:
        _sync(model.device)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        _sync(model.device)
        return time.perf_counter() - t

    run(4)
    t1 = run(1)
    tn = run(max_tokens + 1)
    return max_tokens / (tn - t1)


def hf_many_requests(path: str, dtype: str, requests, mode: str, budget_s: float | None, batch: int = 16,
                     device: str = "cpu") -> dict:
    """transformers on the request mix in a child process (bench/peers/hf_many.py): ``padded``
    ``generate`` in batches of ``batch``, or its continuous batching (the manager behind
    ``generate_batch``, each request with its own length). The budget's clock starts once the
    model is loaded and warmed up, as keyserve's does; ``None`` runs it to the end. Returns what
    it did: ``{tokens, requests, total_requests, elapsed, finished, budget_s, error}``."""
    spec = {"model": path, "dtype": dtype, "threads": torch.get_num_threads(), "mode": mode, "batch": batch,
            "device": device, "requests": [(r.prompt_token_ids, r.max_tokens) for r in requests]}
    out = hf_many.run(sys.executable, spec, budget_s if budget_s else float("inf"), f"transformers {mode} {dtype}")
    return dict(out, budget_s=budget_s or None, tok_s=useful_tok_s(out["tokens"], out["elapsed"]))


RESULTS = Path(__file__).resolve().parent.parent / "docs" / "bench_generate.json"


def _load_avg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def measure_dtype(dtype: str, args: argparse.Namespace, bw: float, fp32_gflops: float) -> dict:
    """Every number of one dtype, keyserve and transformers side by side in this process."""
    from transformers import AutoModelForCausalLM

    from keyserve import LLM

    load_before = _load_avg()
    gflops = measure_matmul_gflops(DTYPES[dtype], repeats=5 if dtype == "float32" else 1)
    llm = LLM(dtype=dtype, kv_cache_memory_gb=6.0, max_num_batched_tokens=2048)
    arch = llm.engine.loaded.config
    path = str(llm.engine.loaded.path)
    tok = llm.tokenizer
    wbytes = weight_bytes_per_token(llm.engine.loaded.model, arch.tie_word_embeddings, arch.vocab_size, arch.hidden_size)
    ks_dec = keyserve_decode(llm, args.decode_tokens)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation="sdpa").eval()
    hf_dec = hf_decode(hf, tok, args.decode_tokens)
    del hf
    reqs = mixed_requests(tok, args.num_requests)
    total_tokens = sum(len(r.prompt_token_ids) + r.max_tokens for r in reqs)
    matmul_params = sum(p.numel() for n, p in llm.engine.loaded.model.named_parameters() if "norm" not in n)
    if not arch.tie_word_embeddings:
        matmul_params -= arch.vocab_size * arch.hidden_size
    ks_tput, ks_el, _ = keyserve_throughput(llm, reqs)
    del llm
    # keyserve widens bf16 weights to float32 GEMM on CPUs without native bf16 (model/matmul.py),
    # so its compute bound is the float32 matmul rate in both dtypes.
    ks_frac = total_tokens * flops_per_token(matmul_params) / ks_el / (fp32_gflops * 1e9)
    budget = args.hf_budget or None
    hf_padded = hf_many_requests(path, dtype, reqs, "padded", args.hf_padded_timeout or budget)
    hf_batch = None
    if not args.skip_hf_batch:
        hf_batch = hf_many_requests(path, dtype, reqs, "continuous", args.hf_batch_timeout or budget)
    return {
        "dtype": dtype, "date": time.strftime("%Y-%m-%d"), "load_before": load_before, "load_after": _load_avg(),
        "bandwidth_gbs": bw, "weight_bytes": wbytes, "bound_tok_s": bw * 1e9 / wbytes,
        "keyserve_decode": ks_dec, "hf_decode": hf_dec, "gflops": gflops, "fp32_gflops": fp32_gflops,
        "keyserve_tput": ks_tput, "keyserve_wall_s": ks_el, "keyserve_compute_frac": ks_frac,
        "hf_padded": hf_padded, "hf_batch": hf_batch,
        "num_requests": args.num_requests, "decode_tokens": args.decode_tokens,
        "threads": torch.get_num_threads(),
        "command": "python bench/generate_bench.py " + " ".join(sys.argv[1:]),
    }


def _hf_ways(r: dict) -> tuple[dict, dict | None]:
    """transformers' two results; records written before the budget excluded model loading
    (old keys) are read as what they said."""
    if "hf_padded" in r:
        return r["hf_padded"], r["hf_batch"]
    total = r["hf_padded_total_batches"] * 16
    padded = {"tokens": round(r["hf_padded_tput"] * r["hf_padded_s"]), "requests": r["hf_padded_batches"] * 16,
              "total_requests": total, "elapsed": r["hf_padded_s"], "tok_s": r["hf_padded_tput"] or None,
              "finished": r["hf_padded_batches"] == r["hf_padded_total_batches"], "error": None,
              "budget_s": r["hf_padded_timeout"]}
    if r.get("hf_batch_timeout") is None:
        return padded, None
    batch = {"tok_s": r["hf_batch_tput"], "finished": True, "old": None if r["hf_batch_tput"] else
             f"no result in {r['hf_batch_timeout']} s, model loading included (a run from before the fair budget)"}
    return padded, batch


def _hf_text(d: dict | None) -> str:
    """tok/s, and what it did when it did not get through every request (never just 'did not finish')."""
    if d is None:
        return "not run"
    if d.get("old"):
        return d["old"]
    txt = f"{d['tok_s']:.1f}" if d["tok_s"] else "0"
    if not d["finished"]:
        why = d["error"] or f"stopped at its {d['budget_s']:.0f} s budget, model loading excluded"
        txt += f" ({d['requests']} of {d['total_requests']} requests, {d['tokens']} tokens in {d['elapsed']:.0f} s; {why})"
    return txt


def tables(records: list[dict]) -> tuple[str, str]:
    dec = markdown_table(
        ["dtype", "keyserve tok/s", "transformers tok/s", "keyserve / transformers", "bandwidth bound tok/s",
         "keyserve % of bound", "transformers % of bound"],
        [[r["dtype"], f"{r['keyserve_decode']:.1f}", f"{r['hf_decode']:.1f}", f"{r['keyserve_decode'] / r['hf_decode']:.2f}×",
          f"{r['bound_tok_s']:.1f}", f"{r['keyserve_decode'] / r['bound_tok_s']:.0%}", f"{r['hf_decode'] / r['bound_tok_s']:.0%}"]
         for r in records],
    )
    rows = []
    for r in records:
        padded, batch = _hf_ways(r)
        rates = [d["tok_s"] for d in (padded, batch) if d and d["tok_s"]]
        ratio = f"{r['keyserve_tput'] / max(rates):.2f}×" if rates else "—"
        rows.append([r["dtype"], f"{r['keyserve_tput']:.1f}", _hf_text(padded), _hf_text(batch), ratio,
                     f"{r['keyserve_wall_s']:.0f}", f"{r['gflops']:.1f}", f"{r['keyserve_compute_frac']:.0%}",
                     r["load_before"]])
    tput = markdown_table(
        ["dtype", "keyserve tok/s", "transformers padded (16) tok/s",
         "transformers continuous batching (generate_batch's) tok/s",
         "keyserve / best transformers", "keyserve wall s", "matmul GFLOP/s (this dtype)",
         "keyserve % of compute bound (fp32 GEMM)", "load avg before"],
        rows,
    )
    return dec, tput


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--hf-budget", type=float, default=0,
                    help="seconds each transformers way gets once its model is loaded (0: the time it needs, "
                         "as keyserve gets); a way stopped by it is reported with the requests it finished")
    ap.add_argument("--hf-padded-timeout", type=float, default=0, help="the padded way's own budget (overrides --hf-budget)")
    ap.add_argument("--hf-batch-timeout", type=float, default=0, help="continuous batching's own budget (overrides --hf-budget)")
    ap.add_argument("--skip-hf-batch", action="store_true")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads for keyserve and transformers alike (0: torch's default); "
                         "1 gives each side one whole core when the machine is shared")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    bw = measure_bandwidth_gbs()
    fp32_gflops = measure_matmul_gflops(torch.float32)
    stored = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for dtype in args.dtypes:
        stored[dtype] = measure_dtype(dtype, args, bw, fp32_gflops)
        dec, tput = tables([stored[dtype]])
        print(f"\nmemory bandwidth (read): {bw:.1f} GB/s\n{dec}\n\n{tput}", flush=True)
        if not args.no_write:
            RESULTS.write_text(json.dumps(stored, indent=2))
    if args.no_write:
        return
    records = [stored[d] for d in DTYPES if d in stored]
    dec_table, tput_table = tables(records)
    _plot({r["dtype"]: (r["keyserve_decode"], r["hf_decode"], r["bound_tok_s"], r["keyserve_tput"],
                        _hf_ways(r)[0]["tok_s"] or 0.0, (_hf_ways(r)[1] or {}).get("tok_s") or 0.0) for r in records},
          Path(__file__).resolve().parent.parent / "docs" / "bench_generate.png")
    runs = "; ".join(f"{r['dtype']}: `{r['command']}` on {r['date']} ({r.get('threads', '?')} torch thread(s) on "
                     f"both sides; load average before {r['load_before']}, after {r['load_after']})" for r in records)
    body = (
        f"Runs: {runs}. Results are kept per dtype in `docs/bench_generate.json`.  \n"
        f"Machine: {machine()}\n\n"
        f"SmolLM2-135M-Instruct, greedy, outputs forced to their length (EOS ignored) on both sides, "
        f"transformers {_transformers_version()} with SDPA attention. Read bandwidth measured in the run "
        f"(a full reduction over 1 GiB): {records[0]['bandwidth_gbs']:.1f} GB/s; the bandwidth bound is that ÷ "
        f"the bytes of weights one decode step reads. Throughput counts generated tokens only (\"useful\"); "
        f"the compute fraction counts 2·params FLOPs for every prompt and generated token against the "
        f"float32 matmul rate measured in the same run ({records[0]['fp32_gflops']:.0f} GFLOP/s).\n\n"
        f"### Batch-1 decode ({records[0]['decode_tokens']} tokens)\n\n{dec_table}\n\n"
        f"### {records[0]['num_requests']} requests, prompts 50–1000 tokens, outputs 16–256 tokens\n\n{tput_table}\n\n"
        f"![generate benchmark](bench_generate.png)\n"
    )
    update_section("generate", "Foundation: generation speed (issue 2)", body)


def machine() -> str:
    import platform

    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"{model}, {os.cpu_count()} cores, no GPU, torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = list(data)
    x = range(len(names))
    w = 0.25
    axes[0].bar([i - w for i in x], [data[n][0] for n in names], w, label="keyserve")
    axes[0].bar(list(x), [data[n][1] for n in names], w, label="transformers")
    axes[0].bar([i + w for i in x], [data[n][2] for n in names], w, label="bandwidth bound")
    axes[0].set_title("batch-1 decode tokens/s")
    axes[1].bar([i - w for i in x], [data[n][3] for n in names], w, label="keyserve")
    axes[1].bar(list(x), [data[n][4] for n in names], w, label="transformers padded")
    axes[1].bar([i + w for i in x], [data[n][5] for n in names], w, label="transformers generate_batch")
    axes[1].set_title("64-request throughput, generated tokens/s")
    for ax in axes:
        ax.set_xticks(list(x), names)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
