"""Distillation data per second: the dense float32 loop against keyserve's engine (issue 19).

A draft is distilled on the target's next-token distributions, recorded two ways: along the
target's own answers (one target forward per token) and along fixed text (teacher-forced: one
causal forward per passage). ``distill-draft`` can record both with its dense float32 model
(``--generator dense``: training/generate.py, corpus.teacher_force) or with the serving engine
(``--generator engine``: training/engine_answers.py). This bench times every producer on the
same prompts and passages, interleaved over ``--rounds`` rounds (median reported, the load
average recorded), and checks what the engine's bfloat16 records give up: how often their
top-1 token is the float32 target's, and how far their top-1 log-probability lies from it.

    python bench/distill_data_bench.py [--prompts 64] [--passages 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.report import BENCHMARKS_MD, markdown_table, update_section  # noqa: E402

from keyserve.config import EngineConfig  # noqa: E402
from keyserve.engine.llm_engine import LLMEngine  # noqa: E402
from keyserve.model.loader import load_model  # noqa: E402
from keyserve.training.corpus import chat_items, passages, teacher_force  # noqa: E402
from keyserve.training.dense import DenseLlama  # noqa: E402
from keyserve.training.distill import _encode_prompts, _stop_ids  # noqa: E402
from keyserve.training.engine_answers import engine_answers, engine_teacher_force  # noqa: E402
from keyserve.training.generate import GenerationJob, generate_answers  # noqa: E402
from keyserve.training.records import Answer  # noqa: E402

TOP_K = 20


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64, help="chat prompts answered per producer and round")
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--passages", type=int, default=48, help="passages teacher-forced per producer and round")
    ap.add_argument("--slots", type=int, default=64, help="sequences at once (both generators)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_model(None, torch.float32, "cpu")
    dense = DenseLlama.from_serving(target.model)
    engines = {dtype: LLMEngine(EngineConfig.from_flat(dtype=dtype, max_num_seqs=args.slots, kv_cache_memory_gb=2.0))
               for dtype in ("float32", "bfloat16")}
    prompts, _ = _encode_prompts(target, args.prompts, seed=11)
    items = [(-1 - i, p, t) for i, (p, t) in
             enumerate(chat_items(target.tokenizer, passages(seed=11)[: args.passages], 256, 11))]

    def job(rnd: int) -> GenerationJob:
        return GenerationJob(prompts, [0.8] * len(prompts), list(range(len(prompts))), args.answer_tokens,
                             _stop_ids(target), top_k=TOP_K, slots=args.slots, seed=rnd)

    def answers_by(make: Callable[[GenerationJob, Callable[[list[Answer]], None]], object]) -> Callable[[int], int]:
        def run(rnd: int) -> int:
            out: list[Answer] = []
            make(job(rnd), out.extend)
            return sum(len(a.tokens) for a in out)
        return run

    forced: dict[str, list[Answer]] = {}

    def forcing_by(name: str, force: Callable[[], list[Answer]]) -> Callable[[int], int]:
        def run(rnd: int) -> int:
            forced[name] = force()
            return sum(len(a.tokens) for a in forced[name])
        return run

    producers: dict[str, tuple[str, Callable[[int], int]]] = {
        "answers: dense float32 loop": ("answers", answers_by(
            lambda j, save: generate_answers(dense, j, float("inf"), save))),
        "answers: engine float32": ("answers", answers_by(
            lambda j, save: engine_answers(engines["float32"], j, float("inf"), save))),
        "answers: engine bfloat16": ("answers", answers_by(
            lambda j, save: engine_answers(engines["bfloat16"], j, float("inf"), save))),
        "teacher-forced: dense float32": ("text", forcing_by("dense", lambda: teacher_force(dense, items, TOP_K))),
        "teacher-forced: engine float32": ("text", forcing_by(
            "engine float32", lambda: engine_teacher_force(engines["float32"], items, TOP_K))),
        "teacher-forced: engine bfloat16": ("text", forcing_by(
            "engine bfloat16", lambda: engine_teacher_force(engines["bfloat16"], items, TOP_K))),
    }
    small = GenerationJob(prompts[:4], [0.8] * 4, list(range(4)), 8, _stop_ids(target), top_k=TOP_K, slots=4)
    generate_answers(dense, small, float("inf"), lambda a: None)  # warm-up of every producer (untimed)
    teacher_force(dense, items[:2], TOP_K)
    for e in engines.values():
        engine_answers(e, small, float("inf"), lambda a: None)
        engine_teacher_force(e, items[:2], TOP_K)
    rates: dict[str, list[float]] = {name: [] for name in producers}
    tokens: dict[str, int] = {}
    loads = [os.getloadavg()[0]]
    bar = tqdm(total=args.rounds * len(producers), desc="distillation data", unit="run")
    names = list(producers)
    for rnd in range(args.rounds):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            n = producers[name][1](rnd)
            rates[name].append(n / (time.perf_counter() - t0))
            tokens[name] = n
            bar.update(1)
        loads.append(os.getloadavg()[0])
    bar.close()
    base = {"answers": statistics.median(rates["answers: dense float32 loop"]),
            "text": statistics.median(rates["teacher-forced: dense float32"])}
    rows = []
    for name, (kind, _) in producers.items():
        med = statistics.median(rates[name])
        rows.append([name, tokens[name], round(med), f"{min(rates[name]):.0f}-{max(rates[name]):.0f}",
                     f"{med / base[kind]:.2f}x"])
    md = markdown_table(["producer", "tokens per round", "tokens/s (median)", "spread", "vs dense float32"], rows)
    fidelity = _fidelity(forced)
    summary = (f"SmolLM2-135M-Instruct; {args.prompts} chat prompts answered at T = 0.8 (up to {args.answer_tokens} "
               f"tokens, EOS ends an answer; each round its own seed, so answer lengths differ between "
               f"producers) and {len(items)} teacher-forced passages (up to 256 tokens) per producer and round, "
               f"top-{TOP_K} recorded; {args.slots} sequences at once; {args.rounds} interleaved rounds, "
               f"{args.threads} threads, 1-min load {min(loads):.2f}-{max(loads):.2f}.")
    print(md)
    print(fidelity)
    print(summary)
    if not args.no_write:
        plot(rates, BENCHMARKS_MD.parent / "bench_distill_data.png")
        update_section("distill_data", "Distillation data per second: the dense float32 loop vs keyserve's engine "
                       "(issue 19)", f"{summary}\n\n{md}\n\n{fidelity}\n\n![distillation data](bench_distill_data.png)\n")


def plot(rates: dict[str, list[float]], path: Path) -> None:
    """Tokens per second of every producer (median bar, min-max whisker), answers and
    teacher-forced text side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rates)
    med = [statistics.median(rates[n]) for n in names]
    err = [[m - min(rates[n]) for m, n in zip(med, names)], [max(rates[n]) - m for m, n in zip(med, names)]]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh(range(len(names)), med, xerr=err, color=["C0" if n.startswith("answers") else "C1" for n in names])
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("recorded tokens per second (median; whiskers: slowest-fastest round)")
    ax.set_title("Distillation data per second: the target's answers and teacher-forced text")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _fidelity(forced: dict[str, list[Answer]]) -> str:
    """How the engine's teacher-forced records compare with the dense float32 ones on the same
    passages: top-1 agreement and the top-1 log-probability's mean absolute difference."""
    ref = {a.prompt_index: a for a in forced["dense"]}
    lines = []
    for name in ("engine float32", "engine bfloat16"):
        same, diff, n = 0, 0.0, 0
        for a in forced[name]:
            r = ref[a.prompt_index]
            same += int((a.topk_ids[:, 0] == r.topk_ids[:, 0]).sum())
            diff += float((a.topk_logprobs[:, 0].float() - r.topk_logprobs[:, 0].float()).abs().sum())
            n += len(a.tokens)
        lines.append(f"{name}: top-1 token equal to the dense float32 record's at {same / n:.4f} of {n} positions, "
                     f"top-1 log-probability off by {diff / n:.4f} on average")
    return "Fidelity of the engine's records (teacher-forced passages, against the dense float32 forward): " + \
        "; ".join(lines) + "."


if __name__ == "__main__":
    main()
