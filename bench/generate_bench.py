"""Foundation benchmark: keyserve vs transformers on SmolLM2-135M-Instruct, on this machine.

1. batch-1 decode tokens/s, and as a fraction of the memory-bandwidth bound (bandwidth measured
   in the same run ÷ bytes of weights read per token);
2. throughput of 64 requests (prompts 50–1000 tokens, outputs 16–256): keyserve's continuous
   batching vs transformers' padded ``generate`` (batches of 16) and its ``generate_batch``, and
   as a fraction of the compute bound (matmul FLOP/s measured in the same run).

    python bench/generate_bench.py [--dtypes float32 bfloat16] [--num-requests 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
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
    llm.generate(CHAT_PROMPT, SamplingParams(max_tokens=4, temperature=0.0), chat=True)  # warm-up
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
def hf_decode(model, tokenizer, max_tokens: int) -> float:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]

    def run(n: int) -> float:
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t

    run(4)
    t1 = run(1)
    tn = run(max_tokens + 1)
    return max_tokens / (tn - t1)


def hf_padded_throughput(model, tokenizer, requests, batch: int = 16) -> tuple[float, float]:
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    t = time.perf_counter()
    useful = 0
    for i in tqdm(range(0, len(requests), batch), desc="transformers padded"):
        chunk = requests[i : i + batch]
        width = max(len(r.prompt_token_ids) for r in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(chunk):
            ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids):] = 1
        n = max(r.max_tokens for r in chunk)
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad)
        useful += sum(r.max_tokens for r in chunk)
    elapsed = time.perf_counter() - t
    return useful / elapsed, elapsed


def hf_generate_batch_subprocess(path: str, dtype: str, num: int, timeout_s: int) -> tuple[float | None, float | None]:
    """transformers' continuous batching, in a child process we can stop at ``timeout_s``."""
    code = f"""
import time, torch, json, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from bench.workloads import mixed_requests
tok = AutoTokenizer.from_pretrained({path!r})
model = AutoModelForCausalLM.from_pretrained({path!r}, dtype=getattr(torch, {dtype!r}), attn_implementation="sdpa")
reqs = mixed_requests(tok, {num})
n = max(r.max_tokens for r in reqs)
cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1)
t = time.perf_counter()
out = model.generate_batch([r.prompt_token_ids for r in reqs], generation_config=cfg, progress_bar=False)
el = time.perf_counter() - t
useful = sum(min(len(o.generated_tokens), r.max_tokens) for o, r in zip(out.values(), reqs))
print(json.dumps({{"tok_s": useful / el, "elapsed": el}}))
"""
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, None
    for line in res.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            d = json.loads(line)
            return d["tok_s"], d["elapsed"]
    print(res.stderr[-2000:], file=sys.stderr)
    return None, None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--hf-batch-timeout", type=int, default=600, help="seconds for generate_batch")
    ap.add_argument("--skip-hf-batch", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from keyserve import LLM

    torch.set_num_threads(torch.get_num_threads())
    bw = measure_bandwidth_gbs()
    decode_rows, tput_rows, plot = [], [], {}
    for dtype in args.dtypes:
        gflops = measure_matmul_gflops(DTYPES[dtype])
        llm = LLM(dtype=dtype, kv_cache_memory_gb=6.0, max_num_batched_tokens=2048)
        arch = llm.engine.loaded.config
        path = str(llm.engine.loaded.path)
        tok = llm.tokenizer
        wbytes = weight_bytes_per_token(llm.engine.loaded.model, arch.tie_word_embeddings, arch.vocab_size, arch.hidden_size)
        bound = bw * 1e9 / wbytes
        ks_dec = keyserve_decode(llm, args.decode_tokens)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation="sdpa").eval()
        hf_dec = hf_decode(hf, tok, args.decode_tokens)
        decode_rows.append([dtype, f"{ks_dec:.1f}", f"{hf_dec:.1f}", f"{ks_dec / hf_dec:.2f}×",
                            f"{bound:.1f}", f"{ks_dec / bound:.0%}", f"{hf_dec / bound:.0%}"])
        reqs = mixed_requests(tok, args.num_requests)
        total_tokens = sum(len(r.prompt_token_ids) + r.max_tokens for r in reqs)
        matmul_params = sum(p.numel() for n, p in llm.engine.loaded.model.named_parameters() if "norm" not in n)
        if not arch.tie_word_embeddings:
            matmul_params -= arch.vocab_size * arch.hidden_size
        ks_tput, ks_el, _ = keyserve_throughput(llm, reqs)
        ks_frac = total_tokens * flops_per_token(matmul_params) / ks_el / (gflops * 1e9)
        hf_tput, hf_el = hf_padded_throughput(hf, tok, reqs)
        del hf
        if args.skip_hf_batch:
            cb_tput = None
        else:
            cb_tput, _ = hf_generate_batch_subprocess(path, dtype, args.num_requests, args.hf_batch_timeout)
        best_hf = max(x for x in (hf_tput, cb_tput) if x is not None)
        cb_txt = f"{cb_tput:.1f}" if cb_tput else f"did not finish in {args.hf_batch_timeout}s"
        tput_rows.append([dtype, f"{ks_tput:.1f}", f"{hf_tput:.1f}", cb_txt, f"{ks_tput / best_hf:.2f}×",
                          f"{ks_el:.0f}", f"{gflops:.0f}", f"{ks_frac:.0%}"])
        plot[dtype] = (ks_dec, hf_dec, bound, ks_tput, hf_tput, cb_tput or 0.0)
        del llm
    dec_table = markdown_table(
        ["dtype", "keyserve tok/s", "transformers tok/s", "ratio", "bandwidth bound tok/s", "keyserve % of bound", "transformers % of bound"],
        decode_rows,
    )
    tput_table = markdown_table(
        ["dtype", "keyserve tok/s", "transformers padded (16) tok/s", "transformers generate_batch tok/s",
         "keyserve / best transformers", "keyserve wall s", "matmul GFLOP/s", "keyserve % of compute bound"],
        tput_rows,
    )
    print(f"memory bandwidth (read): {bw:.1f} GB/s\n")
    print(dec_table + "\n\n" + tput_table)
    if args.no_write:
        return
    _plot(plot, Path(__file__).resolve().parent.parent / "docs" / "bench_generate.png")
    body = (
        f"SmolLM2-135M-Instruct, greedy, outputs forced to their length (EOS ignored) on both sides. "
        f"Measured read bandwidth {bw:.1f} GB/s; the bandwidth bound is that ÷ the bytes of weights "
        f"one decode step reads. Throughput counts generated tokens only (\"useful\"); the compute "
        f"fraction counts 2·params FLOPs for every prompt and generated token against the matmul "
        f"FLOP/s measured in the same run.\n\n### Batch-1 decode ({args.decode_tokens} tokens)\n\n{dec_table}\n\n"
        f"### {args.num_requests} requests, prompts 50–1000 tokens, outputs 16–256 tokens\n\n{tput_table}\n\n"
        f"![generate benchmark](bench_generate.png)\n"
    )
    update_section("generate", "Foundation: generation speed (issue 2)", body)


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
