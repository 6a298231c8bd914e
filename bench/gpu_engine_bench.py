"""The whole engine on a GPU: keyserve against transformers on the same card, SmolLM2-135M-shaped.

The real SmolLM2 weights (538 MB) cannot travel to a lent GPU machine (its working tree is
limited to 64 MiB), so unless ``--model`` names a checkpoint, the model is SmolLM2-135M-Instruct's
own config and tokenizer with weights drawn as transformers initialises them (seeded). With EOS
ignored on both sides every request decodes to its length, so speed does not depend on the
weight values; tokens do, and this bench says nothing about them (tests/engine/test_cuda_engine.py
checks the GPU's tokens against the CPU's).

1. batch-1 decode tok/s after a chat prompt: keyserve vs transformers ``generate``, and against
   the bandwidth bound (device-to-device copy bandwidth measured in the run ÷ weight bytes read
   per token);
2. 64 requests (prompts 50–1000 tokens, outputs 16–256, the CPU benches' mix): keyserve's
   continuous batching vs transformers' padded ``generate`` (batches of 16) and its continuous
   batching (``generate_batch``'s manager), each given the same budget once loaded.

    python bench/gpu_engine_bench.py --config-dir DIR [--md docs/BENCHMARKS.md] [--json FILE]
    python bench/gpu_engine_bench.py --smoke     # on the CPU, a few requests: checks the script
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.generate_bench import (  # noqa: E402
    CHAT_PROMPT,
    _sync,
    hf_decode,
    hf_many_requests,
    keyserve_decode,
    weight_bytes_per_token,
)
from bench.report import BENCHMARKS_MD, markdown_table, update_section  # noqa: E402
from bench.workloads import mixed_requests  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")


def random_checkpoint(config_dir: Path, out: Path) -> Path:
    """``config_dir``'s model with seeded random weights, saved as a checkpoint beside its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(config_dir)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (config_dir / name).exists():
            shutil.copy(config_dir / name, out / name)
    return out


def copy_bandwidth_gbs(device: str, gib: float = 2.0) -> float:
    """Bytes read + written per second by a large same-device copy, the best of five."""
    src = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        _sync(src.device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(src.device)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() / best / 1e9


def keyserve_many(llm, requests) -> dict:  # noqa: ANN001
    from keyserve import SamplingParams

    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
    llm.generate([r.prompt_token_ids for r in requests[:4]], params[:4])  # warm-up: kernels compiled
    llm.engine.block_manager.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=True)
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tokens": tokens, "elapsed": elapsed, "tok_s": tokens / elapsed}


def profile_decode(llm, steps: int, out_dir: Path | None) -> str:  # noqa: ANN001
    """Where a batch-1 decode step's time goes: cProfile (Python) and torch.profiler (ops, kernels)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from keyserve import SamplingParams
    from bench.workloads import step_until_decoding

    engine = llm.engine
    engine.add_request(CHAT_PROMPT, SamplingParams(max_tokens=3 * steps + 64, temperature=0.0, ignore_eos=True))
    step_until_decoding(engine, 1)
    for _ in range(8):
        engine.step()
    _sync(llm.engine.runner.device)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall_ms = (time.perf_counter() - t) / steps * 1e3
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as tp:
        for _ in range(steps):
            engine.step()
    by_cpu = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    by_dev = tp.key_averages().table(sort_by="self_device_time_total", row_limit=15) if len(acts) > 1 else ""
    text = (f"batch-1 decode step: {wall_ms:.2f} ms wall (mean of {steps})\n\n== cProfile, by own time\n"
            f"{buf.getvalue()}\n== torch.profiler, by self CPU\n{by_cpu}\n== by device time\n{by_dev}\n")
    if out_dir is not None:
        (out_dir / "gpu_step_profile.txt").write_text(text)
    return text


def measure(path: str, dtype: str, device: str, args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    from keyserve import LLM

    bw = copy_bandwidth_gbs(device, 0.25 if args.smoke else 2.0)
    llm = LLM(path, device=device, dtype=dtype, kv_cache_memory_gb=args.kv_gb, max_num_batched_tokens=2048)
    tok = llm.tokenizer
    arch = llm.engine.loaded.config
    wbytes = weight_bytes_per_token(llm.engine.loaded.model, arch.tie_word_embeddings, arch.vocab_size,
                                    arch.hidden_size)
    ks_dec = keyserve_decode(llm, args.decode_tokens)
    reqs = mixed_requests(tok, args.num_requests, prompt_range=(50, min(1000, args.max_prompt)))
    ks_many = keyserve_many(llm, reqs)
    graphs = llm.engine.runner.graphs
    recorded = sorted(graphs.graphs) if graphs is not None else []
    if args.profile_steps:
        print(profile_decode(llm, args.profile_steps, args.json.parent if args.json else None), flush=True)
    del llm
    eager_dec = eager_many = None
    if device == "cuda" and not args.skip_eager:  # the same engine without CUDA graphs
        llm = LLM(path, device=device, dtype=dtype, kv_cache_memory_gb=args.kv_gb, max_num_batched_tokens=2048,
                  enforce_eager=True)
        eager_dec, eager_many = keyserve_decode(llm, args.decode_tokens), keyserve_many(llm, reqs)
        del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    hf = hf.to(device).eval()
    hf_dec = hf_decode(hf, tok, args.decode_tokens)
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    padded = hf_many_requests(path, dtype, reqs, "padded", args.hf_budget, device=device)
    cont = None if args.skip_hf_batch else hf_many_requests(path, dtype, reqs, "continuous", args.hf_budget,
                                                            device=device)
    return {"dtype": dtype, "device": device, "date": time.strftime("%Y-%m-%d"), "bandwidth_gbs": bw,
            "weight_bytes": wbytes, "bound_tok_s": bw / 2 * 1e9 / wbytes, "keyserve_decode": ks_dec,
            "hf_decode": hf_dec, "keyserve_many": ks_many, "eager_decode": eager_dec, "eager_many": eager_many,
            "graph_buckets": recorded, "hf_padded": padded, "hf_batch": cont,
            "num_requests": args.num_requests, "decode_tokens": args.decode_tokens,
            "weights": "real" if args.model else "random (SmolLM2 config and tokenizer)"}


def _many_text(d: dict | None) -> str:
    if d is None:
        return "not run"
    text = f"{d['tok_s']:.0f}" if d.get("tok_s") else "0"
    if not d.get("finished", True):
        why = d.get("error") or f"stopped at its {d.get('budget_s') or 0:.0f} s budget"
        text += f" ({d['requests']} of {d['total_requests']} requests in {d['elapsed']:.0f} s; {why})"
    return text


def render(records: list[dict]) -> str:
    def eager(r: dict, key: str, fmt: str = "{:.0f}") -> str:
        v = r.get(key)
        return "not run" if v is None else fmt.format(v if key == "eager_decode" else v["tok_s"])

    dec = markdown_table(
        ["dtype", "keyserve tok/s (CUDA graphs)", "keyserve eager tok/s", "transformers tok/s",
         "keyserve / transformers", "bandwidth bound tok/s", "keyserve % of bound"],
        [[r["dtype"], f"{r['keyserve_decode']:.0f}", eager(r, "eager_decode"), f"{r['hf_decode']:.0f}",
          f"{r['keyserve_decode'] / r['hf_decode']:.2f}×", f"{r['bound_tok_s']:.0f}",
          f"{r['keyserve_decode'] / r['bound_tok_s']:.1%}"] for r in records])
    rows = []
    for r in records:
        rates = [d["tok_s"] for d in (r["hf_padded"], r["hf_batch"]) if d and d.get("tok_s")]
        best = f"{r['keyserve_many']['tok_s'] / max(rates):.2f}×" if rates else "—"
        rows.append([r["dtype"], f"{r['keyserve_many']['tok_s']:.0f}", f"{r['keyserve_many']['elapsed']:.1f}",
                     eager(r, "eager_many"), _many_text(r["hf_padded"]), _many_text(r["hf_batch"]), best])
    many = markdown_table(["dtype", "keyserve tok/s (CUDA graphs)", "keyserve wall s", "keyserve eager tok/s",
                           "transformers padded (16) tok/s", "transformers continuous batching tok/s",
                           "keyserve / best transformers"], rows)
    r0 = records[0]
    return (f"Weights: {r0['weights']}; EOS ignored on both sides, greedy. Copy bandwidth measured in the "
            f"run (bytes read + written): {r0['bandwidth_gbs']:.0f} GB/s; the bound is half that (the read "
            f"side) ÷ {r0['weight_bytes'] / 1e6:.0f} MB of weights per step. CUDA graphs recorded for "
            f"decode steps of {', '.join(map(str, r0.get('graph_buckets') or [])) or 'no'} rows.\n\n"
            f"### Batch-1 decode ({r0['decode_tokens']} tokens)\n\n{dec}\n\n"
            f"### {r0['num_requests']} requests, prompts 50–1000 tokens, outputs 16–256\n\n{many}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a checkpoint with real weights (default: random weights)")
    ap.add_argument("--config-dir", type=Path, default=None, help="config + tokenizer for the random model")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=1000)
    ap.add_argument("--kv-gb", type=float, default=4.0)
    ap.add_argument("--hf-budget", type=float, default=120.0, help="seconds each transformers way gets once loaded")
    ap.add_argument("--skip-hf-batch", action="store_true")
    ap.add_argument("--skip-eager", action="store_true", help="skip the engine without CUDA graphs")
    ap.add_argument("--md", type=Path, default=BENCHMARKS_MD)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="also profile this many batch-1 decode steps (cProfile and torch.profiler)")
    ap.add_argument("--profile-only", action="store_true", help="only the profile, no comparison")
    ap.add_argument("--smoke", action="store_true", help="CPU, stories260K-sized run that checks the script")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.num_requests, args.decode_tokens, args.max_prompt, args.kv_gb = 4, 8, 200, 0.2
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or str(random_checkpoint(args.config_dir, Path(tmp) / "model"))
        if args.profile_only:
            from keyserve import LLM

            llm = LLM(path, device=device, dtype=args.dtypes[0], kv_cache_memory_gb=args.kv_gb)
            keyserve_decode(llm, 16)
            print(profile_decode(llm, args.profile_steps or 32, args.json.parent if args.json else None))
            return
        records = [measure(path, dtype, device, args) for dtype in args.dtypes]
    body = render(records)
    print(body, flush=True)
    if args.json:
        args.json.write_text(json.dumps(records, indent=2))
    if not args.smoke:
        update_section("engine_gpu", "The engine on a GPU: keyserve vs transformers (SmolLM2-135M shape)", body,
                       path=args.md)


if __name__ == "__main__":
    main()
