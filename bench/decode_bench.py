"""Batch-1 (and few-row) decode of the default model against the memory-bandwidth bound.

A decode step of a small model at batch 1 reads every weight once, so its ceiling is
``read bandwidth / bytes of weights``. This bench measures, in the same interleaved rounds
and at the same thread count:

- the read bandwidth: one streaming pass over a buffer the size of the float32 weights
  (``keyserve_read_stream``, the threads each reading one contiguous half), on 4 KB pages and
  on huge pages (where the weights live), the better of the two;
- the GEMV pass: every weight matrix once through the native row-major GEMV, one Python call
  (and one OpenMP fork) per matrix -- no norms or attention, but 121 calls' overhead;
- decode tok/s of the model forward plus the LM head over the one sampled row, float32 and
  bfloat16, three ways: "before" (the torch layers as they were before the native step:
  float32 weights column-major through skinny_linear.c, bf16 through torch's GEMV), "torch
  layers" (``model._native_decode = None``: torch per layer, the native GEMV per linear) and
  "native" (the one-call step, kernels/native/decode_stack.c),

and reports the native path as a share of the bound. The load average is recorded beside every
round; rounds with a 1-minute load above ``--max-load`` are dropped (the machine is shared).
Writes the "decode" section of docs/BENCHMARKS.md.

    python bench/decode_bench.py [--threads 2] [--rounds 5] [--steps 64] [--rows 1 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.report import markdown_table, update_section  # noqa: E402
from keyserve.kernels import huge_pages  # noqa: E402
from keyserve.kernels.metadata import AttentionMetadata  # noqa: E402
from keyserve.kernels.native import library  # noqa: E402
from keyserve.kernels.native import gemv as native_gemv  # noqa: E402
from keyserve.kernels.native.gemv import gemv_float, read_stream_gbps  # noqa: E402
from keyserve.model.kv_cache import allocate_kv_cache  # noqa: E402
from keyserve.model.llama import LlamaForCausalLM  # noqa: E402
from keyserve.model.loader import load_model  # noqa: E402
from keyserve.model.matmul import use_cpu_gemv_layout  # noqa: E402

BLOCK = 16


def load1() -> float:
    return os.getloadavg()[0]


def weight_matrices(model: LlamaForCausalLM) -> list[torch.Tensor]:
    """Every matrix a decode step reads in full: the layers' and the LM head."""
    mats = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        mats += [a.qkv_proj.weight, a.o_proj.weight, m.gate_up_proj.weight, m.down_proj.weight]
    return mats + [model.lm_head_weight]


class Decoder:
    """Batch of ``rows`` sequences over a contiguous-per-sequence paged cache."""

    def __init__(self, model: LlamaForCausalLM, rows: int, prompt: int, steps: int) -> None:
        self.model, self.rows = model, rows
        blocks_per_seq = (prompt + steps + BLOCK - 1) // BLOCK + 1
        self.kv = allocate_kv_cache(model.config, rows * blocks_per_seq, BLOCK, model.dtype, "cpu")
        self.tables = torch.arange(rows * blocks_per_seq, dtype=torch.int32).view(rows, blocks_per_seq)
        self.len = prompt
        ids = torch.randint(0, model.config.vocab_size, (rows * prompt,), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(prompt).repeat(rows)
        slots = (self.tables[:, :, None] * BLOCK + torch.arange(BLOCK)).view(rows, -1)[:, :prompt].reshape(-1)
        meta = AttentionMetadata(
            slot_mapping=slots.long(), num_decode_seqs=0,
            decode_block_tables=torch.zeros(0, blocks_per_seq, dtype=torch.int32),
            decode_context_lens=torch.zeros(0, dtype=torch.int32), prefill_block_tables=self.tables,
            prefill_query_start_loc=torch.arange(rows + 1, dtype=torch.int32) * prompt,
            prefill_context_lens=torch.full((rows,), prompt, dtype=torch.int32),
        )
        with torch.inference_mode():
            model(ids, pos, self.kv, meta)
        self.token = torch.zeros(rows, dtype=torch.int64)

    def step(self) -> torch.Tensor:
        p = self.len
        pos = torch.full((self.rows,), p, dtype=torch.int64)
        slots = (self.tables[:, p // BLOCK] * BLOCK + p % BLOCK).long()
        meta = AttentionMetadata(
            slot_mapping=slots, num_decode_seqs=self.rows, decode_block_tables=self.tables,
            decode_context_lens=torch.full((self.rows,), p + 1, dtype=torch.int32),
            prefill_block_tables=self.tables[:0], prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
            prefill_context_lens=torch.zeros(0, dtype=torch.int32),
        )
        hidden, _ = self.model(self.token, pos, self.kv, meta)
        logits = self.model.compute_logits(hidden)
        self.token = logits.argmax(-1)
        self.len += 1
        return logits

    def timed_steps(self, steps: int, after_each=None) -> list[float]:  # noqa: ANN001
        """Seconds of each of ``steps`` steps (``after_each()`` runs untimed after each)."""
        times = []
        with torch.inference_mode():
            for _ in range(steps):
                t = time.perf_counter()
                self.step()
                times.append(time.perf_counter() - t)
                if after_each is not None:
                    after_each()
        return times


def decode_rate(model: LlamaForCausalLM, mode: str, rows: int, steps: int, prompt: int) -> float:
    """Tokens/s (per sequence) of ``steps`` decode steps: median step time. mode: "native",
    "torch" (torch layers) or "before" (``model`` is the column-major copy; the row-major
    GEMV route is switched off, as it did not exist)."""
    stack = model._native_decode
    model._native_decode = stack if mode == "native" else None
    route = native_gemv.supports
    if mode == "before":
        native_gemv.supports = lambda *a, **k: False  # matmul.linear and compute_logits look it up here
    try:
        times = Decoder(model, rows, prompt, steps).timed_steps(steps)
    finally:
        model._native_decode = stack
        native_gemv.supports = route
    return 1.0 / statistics.median(times)


def gemv_floor_s(mats: list[torch.Tensor]) -> float:
    xs: dict[int, torch.Tensor] = {}
    t = time.perf_counter()
    with torch.inference_mode():
        for w in mats:
            x = xs.setdefault(w.shape[1], torch.randn(1, w.shape[1]).to(w.dtype))
            gemv_float(x, w)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--max-load", type=float, default=3.0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if library() is None:
        sys.exit("decode_bench: the native kernels could not be built (no C compiler?)")
    torch.set_num_threads(args.threads)
    models = {name: load_model(None, dtype=getattr(torch, name), progress=False).model for name in args.dtypes}
    before = {}
    for name in args.dtypes:  # the pre-native layout: float32 column-major (bf16 unchanged)
        if name == "float32":
            old = load_model(None, dtype=torch.float32, progress=False).model
            use_cpu_gemv_layout(old)
            old._native_decode = None  # it held the row-major copies
            before[name] = old
        else:
            before[name] = models[name]
    mats = {name: weight_matrices(m) for name, m in models.items()}
    nbytes = {name: sum(w.numel() * w.element_size() for w in ws) for name, ws in mats.items()}
    n = max(nbytes.values()) // 4
    # on ordinary and on huge pages (kernels/huge_pages.py, where the weights live): the better
    bufs = [torch.ones(n)] + ([huge_pages.empty(n, torch.float32).fill_(1.0)] if huge_pages.available() else [])
    samples: dict[tuple, list[float]] = {}
    loads: list[float] = []
    for r in range(args.rounds):
        load = load1()
        round_samples: dict[tuple, float] = {}
        round_samples[("bw",)] = max(read_stream_gbps(buf, args.threads)[1] for buf in bufs for _ in range(3))
        for name, model in models.items():
            round_samples[("gemv", name)] = nbytes[name] / min(gemv_floor_s(mats[name]) for _ in range(3)) / 1e9
            for rows in args.rows:
                for mode in ("before", "torch", "native"):
                    net = before[name] if mode == "before" else model
                    round_samples[(name, rows, mode)] = decode_rate(net, mode, rows, args.steps, args.prompt)
        load = max(load, load1())
        kept = load <= args.max_load
        print(f"round {r}: load {load:.2f}{'' if kept else ' (dropped)'} "
              + " ".join(f"{k}={v:.1f}" for k, v in round_samples.items()), flush=True)
        if kept:
            loads.append(load)
            for k, v in round_samples.items():
                samples.setdefault(k, []).append(v)
    if not loads:
        sys.exit(f"decode_bench: every round ran above load {args.max_load}; nothing to report")
    bw = statistics.median(samples[("bw",)])
    rows_out = []
    for name in models:
        gb = nbytes[name] / 1e9
        bound = bw / gb
        gemv = statistics.median(samples[("gemv", name)])
        for rows in args.rows:
            t_before = statistics.median(samples[(name, rows, "before")])
            t_torch = statistics.median(samples[(name, rows, "torch")])
            t_nat = statistics.median(samples[(name, rows, "native")])
            rows_out.append([
                name, rows, f"{gb * 1e3:.0f}", f"{bw:.1f}", f"{bound:.1f}", f"{gemv / bw:.0%}",
                f"{t_before:.1f}", f"{t_torch:.1f}", f"{t_nat:.1f}", f"{t_nat / t_before:.2f}×",
                f"{t_nat * rows / bound:.0%}",
            ])
    table = markdown_table(
        ["dtype", "rows", "weights MB", "read GB/s", "bound tok/s (1 row)", "GEMV pass, share of bandwidth",
         "before tok/s per seq", "torch layers tok/s per seq", "native tok/s per seq",
         "native / before", "native share of bound"],
        rows_out,
    )
    body = (
        f"SmolLM2-135M-Instruct, {args.threads} threads, a {args.prompt}-token prompt then "
        f"{args.steps} greedy decode steps per path per round (median step: model forward + LM "
        f"head over the sampled rows), {len(loads)} of {args.rounds} interleaved rounds kept "
        f"(1-minute load average {min(loads):.2f}-{max(loads):.2f}, threshold {args.max_load}). "
        "Bound = read bandwidth (one streaming pass over a weight-sized buffer on 4 KB and on "
        "huge pages, the better of the two; same threads, same rounds) / bytes of weights read "
        "per step (all layers + the tied 49152x576 LM head). 'share of bound' is rows x tok/s "
        "per sequence / bound: the fraction of the bandwidth the step turns into weight reads. "
        "It is a DRAM bound: a share above 100 % means part of the weights were still in the "
        "last-level cache from the previous step (which a CPU with a large L3 allows).\n\n" + table
    )
    print(table)
    if not args.no_write:
        update_section("decode", "Batch-1 decode vs the memory-bandwidth bound (native CPU decode)", body)


if __name__ == "__main__":
    main()
