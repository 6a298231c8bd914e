"""Time to first token of one long prompt on the CPU under each KV policy.

Under H2O / Keyformer the prompt's prefill also returns attention scores (a second pass over the
query chunks), so it costs more than full attention's; this records how much. One process, the
policies interleaved per repetition, fastest of ``--reps`` counts. Prints a table, writes the
"prefill" section of docs/BENCHMARKS.md.

    python bench/prefill_bench.py [--tokens 3300] [--threads 2] [--reps 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.kv_docs import build_documents  # noqa: E402
from bench.report import markdown_table, update_section  # noqa: E402

from keyserve import LLM, SamplingParams  # noqa: E402

POLICIES = {"full": {}, "h2o@0.5": dict(kv_policy="h2o", kv_budget=0.5),
            "keyformer@0.5": dict(kv_policy="keyformer", kv_budget=0.5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=3300, help="prompt length (a Python reference section)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(None, dtype="float32", enable_prefix_caching=False)
    doc = build_documents(llm.tokenizer, 1, args.tokens - 100, args.tokens + 100, args.tokens)[0]
    ids = llm.tokenizer.encode(doc.text)[: args.tokens]
    best = {name: float("inf") for name in POLICIES}
    for _ in range(args.reps):
        for name, kw in POLICIES.items():
            t = time.perf_counter()
            llm.generate([ids], SamplingParams(max_tokens=1, **kw))
            best[name] = min(best[name], time.perf_counter() - t)
            print(f"{name}: {time.perf_counter() - t:.2f} s", flush=True)
    rows = [[name, f"{s:.2f}", f"{s / best['full']:.2f}×", f"{len(ids) / s:.0f}"] for name, s in best.items()]
    table = markdown_table(["policy", "TTFT s", "vs full", "prompt tokens/s"], rows)
    body = (f"{args.threads} torch thread(s). One prompt of {len(ids)} tokens (SmolLM2-135M-Instruct, float32, one token generated, prefix "
            f"caching off, chunked at the engine's default token budget), fastest of {args.reps}, policies "
            f"interleaved in one process.\n\n{table}")
    print(table)
    if not args.no_write:
        update_section("prefill", "CPU prefill: time to first token per KV policy", body)


if __name__ == "__main__":
    main()
