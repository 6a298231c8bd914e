"""One engine, one precision, one process: batch-1 decode and prefill speed, printed as JSON.

Run by bench/peer_bench.py, once per engine and precision per round, under the interpreter that
engine lives in (keyserve and transformers: keyserve's .venv; llama.cpp: the bench-only venv,
which cannot import keyserve), so this file imports nothing of keyserve's at module level.

Every engine is measured the same way, on the same token ids:
* model loading is not timed;
* warm-up: one short decode (8 tokens) and one prefill of the long prompt;
* decode: greedy, EOS ignored, ``decode_tokens + 1`` tokens after the short prompt;
  tok/s = ``decode_tokens`` ÷ the time from the first generated token to the last
  (so the prefill is not in it);
* prefill: the long prompt with nothing cached, one token generated; tok/s = prompt tokens ÷
  time to first token;
* the 1-minute load average is read right before each timed measurement.

    python bench/peers/worker.py SPEC.json     # prints one JSON line
"""

from __future__ import annotations

import json
import sys
import time
from typing import Callable

WARMUP_DECODE_TOKENS = 8
AGREEMENT_TOKENS = 16  # greedy tokens reported, to check every engine computes the same model


def load_1min() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


# ------------------------------------------------------------------ engines
# Each engine is a pair of callables on token ids:
#   decode(ids, n) -> (t_first, t_last, tokens): wall clock at the first and the n-th generated
#                     token, and the generated token ids
#   prefill(ids)   -> seconds to the first token of ``ids`` with nothing cached


def keyserve_engine(spec: dict) -> tuple[Callable, Callable]:
    import torch

    torch.set_num_threads(spec["threads"])
    from keyserve import LLM, SamplingParams

    # prefix caching off: the warm-up must not make the timed prefill a cache hit
    llm = LLM(spec["model"], dtype=spec["precision"], enable_prefix_caching=False)
    engine = llm.engine

    def run(ids: list[int], n: int) -> tuple[float, float, list[int]]:
        engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), prompt_token_ids=ids)
        t_first, last = None, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if t_first is None and out.outputs and out.outputs[0].token_ids:
                    t_first = time.perf_counter()
                last = out
        return t_first or time.perf_counter(), time.perf_counter(), list(last.token_ids)

    def prefill(ids: list[int]) -> float:
        t = time.perf_counter()
        run(ids, 1)
        return time.perf_counter() - t

    return run, prefill


def transformers_engine(spec: dict) -> tuple[Callable, Callable]:
    import torch

    torch.set_num_threads(spec["threads"])
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, spec["precision"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype, attn_implementation="sdpa").eval()

    def gen(ids: list[int], n: int) -> tuple[float, list[int]]:
        x = torch.tensor([ids])
        t = time.perf_counter()
        with torch.no_grad():
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
        return time.perf_counter() - t, y[0, len(ids):].tolist()

    def run(ids: list[int], n: int) -> tuple[float, float, list[int]]:
        # generate() has no per-token clock: (n tokens) − (1 token) is the decode of n − 1 tokens
        one, _ = gen(ids, 1)
        full, toks = gen(ids, n)
        return 0.0, full - one, toks

    def prefill(ids: list[int]) -> float:
        return gen(ids, 1)[0]

    return run, prefill


def llama_cpp_engine(spec: dict) -> tuple[Callable, Callable]:
    import llama_cpp.llama_cpp as low  # the module Llama() reads its default parameters from
    from llama_cpp import Llama

    if spec.get("no_repack"):  # llama-server's --no-repack: no extra buffer types (AMX, repacked weights)
        default_params = low.llama_model_default_params

        def no_extra_bufts():  # noqa: ANN202
            params = default_params()
            params.use_extra_bufts = False
            return params

        low.llama_model_default_params = no_extra_bufts
    n = spec["threads"]
    llm = Llama(model_path=spec["model"], n_ctx=spec.get("n_ctx", 2048), n_batch=spec.get("n_batch", 2048),
                n_ubatch=spec.get("n_ubatch", 512), n_threads=n, n_threads_batch=n, verbose=False)

    def run(ids: list[int], n_tokens: int) -> tuple[float, float, list[int]]:
        llm.reset()
        t_first = None
        toks: list[int] = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):  # greedy, never stops at EOS
            toks.append(int(tok))
            if t_first is None:
                t_first = time.perf_counter()
            if len(toks) >= n_tokens:
                break
        return t_first, time.perf_counter(), toks

    def prefill(ids: list[int]) -> float:
        llm.reset()  # n_tokens = 0: eval() drops the whole KV cache, nothing is reused
        t = time.perf_counter()
        llm.eval(ids)
        llm.sample(top_k=1, top_p=1.0, temp=0.0)
        return time.perf_counter() - t

    return run, prefill


ENGINES = {"keyserve": keyserve_engine, "transformers": transformers_engine, "llama.cpp": llama_cpp_engine}


def measure(spec: dict) -> dict:
    """Load, warm up, then time decode and prefill once each (see the module docstring)."""
    t = time.perf_counter()
    decode_run, prefill_run = ENGINES[spec["engine"]](spec)
    load_s = time.perf_counter() - t
    short, long_ = spec["decode_prompt"], spec["prefill_prompt"]
    n = spec["decode_tokens"]
    decode_run(short, WARMUP_DECODE_TOKENS)
    prefill_run(long_)
    load_decode = load_1min()
    t_first, t_last, tokens = decode_run(short, n + 1)
    load_prefill = load_1min()
    ttft = prefill_run(long_)
    return {
        "engine": spec["engine"], "precision": spec["precision"], "load_model_s": load_s,
        "decode_tok_s": n / (t_last - t_first), "decode_tokens": n, "load_decode": load_decode,
        "first_tokens": tokens[:AGREEMENT_TOKENS],
        "prefill_tok_s": len(long_) / ttft, "prefill_tokens": len(long_), "load_prefill": load_prefill,
    }


def bandwidth(spec: dict) -> dict:
    """Memory read bandwidth at ``threads`` threads: torch's sum over a 1 GiB float32 buffer (far
    beyond any last-level cache), best of 5 after one untimed pass; bytes read ÷ seconds. Read
    on ordinary 4 KB pages and on transparent huge pages (keyserve/kernels/huge_pages.py; the
    same sum reads ~35 % faster there on the Xeon, its TLB and prefetcher no longer stopping
    every 4 KB): the bound is the better of the two, what the memory can deliver."""
    import torch

    from keyserve.kernels import huge_pages

    torch.set_num_threads(spec["threads"])
    n = int(spec.get("gib", 1.0) * (1 << 30)) // 4
    load = load_1min()
    rates = {}
    for pages in ("4k", "huge"):
        if pages == "huge" and not huge_pages.available():
            continue
        x = huge_pages.empty(n, torch.float32) if pages == "huge" else torch.empty(n, dtype=torch.float32)
        x.fill_(1.0)
        x.sum()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        rates[pages] = x.numel() * 4 / best / 1e9
        del x
    return {"engine": "bandwidth", "bandwidth_gbs": max(rates.values()), "bandwidth_by_pages": rates, "load": load}


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    out = bandwidth(spec) if spec["engine"] == "bandwidth" else measure(spec)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
