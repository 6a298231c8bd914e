"""Adaptive K on a stream of short requests: with and without its outcome guard, against plain
decoding and fixed K, on SmolLM2-135M-Instruct with the committed draft.

Why this workload: when requests keep arriving, a new sequence starts drafting in nearly every
step, and its first drafting step makes the draft read its whole prompt. The step cost model
(``core.step_cost``) leaves such catch-up steps out, so it may never measure what drafting costs,
and adaptive K then drafts on its prior (1 + c·K). The guard (``core.spec_guard``) judges the
drafting steps by the tokens per second they delivered, catch-ups included. This bench shows
what each gets on the same engine, in interleaved rounds.

Workload: ``--requests`` chat prompts (the spec bench's 16, cycled) with output lengths spread
over ``--min-tokens``..``--max-tokens`` (EOS ignored) so that they finish at different steps and
the next one is admitted (``max_num_seqs`` = ``--batch``), greedy or at ``--temperature``.
Configurations: plain (``speculative=False``), fixed K, adaptive K (cap K) with the guard, and
adaptive K with the guard switched off (its ``min_steps`` out of reach). Each adaptive
configuration starts from fresh adaptive state (cost models, acceptance, guard) every round, as a
server's would after a restart, so the rounds do not teach each other. Reported: generated
tokens / wall time, median and min-max over rounds.

    python bench/spec_stream_bench.py [--requests 64] [--batch 8] [--rounds 3]

Writes the "speculative_stream" section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.report import markdown_table, update_section  # noqa: E402
from bench.spec_bench import PROMPTS  # noqa: E402

CONFIGS = ("plain", "fixed K", "adaptive + guard", "adaptive, no guard")


def _fresh_policy(llm, adaptive: bool, guard: bool) -> None:  # noqa: ANN001
    """The engine's speculative policy rebuilt: adaptive K on or off, its learnt state dropped,
    the guard kept or switched off."""
    from keyserve.engine.speculative import SpeculativeDecoder

    old = llm.engine.speculative
    new = SpeculativeDecoder(old.drafter, old.config.model_copy(update={"adaptive_k": adaptive}), old.cost_ratio)
    if not guard:
        new.guard.min_steps = 10**9
    llm.engine.speculative = new


def run(llm, config: str, args: argparse.Namespace) -> tuple[int, float, dict]:  # noqa: ANN001
    from keyserve import SamplingParams

    _fresh_policy(llm, adaptive=config.startswith("adaptive"), guard=config != "adaptive, no guard")
    span = args.max_tokens - args.min_tokens + 1
    params = [SamplingParams(max_tokens=args.min_tokens + (i * 7) % span, temperature=args.temperature,
                             ignore_eos=True, seed=i, speculative=config != "plain",
                             num_speculative_tokens=args.k) for i in range(args.requests)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    llm.engine.block_manager.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, chat=True)
    seconds = time.perf_counter() - start
    policy = llm.engine.speculative
    sampled = args.temperature > 0
    info = {"losses": policy.guard.losses(args.batch, sampled), "drafted": policy.stats.num_draft_tokens,
            "accepted": policy.stats.num_accepted_tokens}
    return sum(len(o.token_ids) for o in outs), seconds, info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="max_num_seqs")
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--k", type=int, default=2, help="fixed K, and adaptive K's cap")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from keyserve import LLM

    load_before = os.getloadavg()[0]
    llm = LLM(draft="default", num_speculative_tokens=args.k, max_num_seqs=args.batch)
    warm = argparse.Namespace(**{**vars(args), "requests": args.batch})
    for config in CONFIGS:  # untimed warm-up of every configuration
        run(llm, config, warm)
    results: dict[str, list[tuple[int, float, dict]]] = {c: [] for c in CONFIGS}
    bar = tqdm(total=args.rounds * len(CONFIGS), desc="stream", unit="config")
    for rnd in range(args.rounds):
        for config in CONFIGS if rnd % 2 == 0 else CONFIGS[::-1]:
            results[config].append(run(llm, config, args))
            tokens, seconds, info = results[config][-1]
            tqdm.write(f"round {rnd + 1} {config:20s} {tokens / seconds:7.1f} tok/s {info}")
            bar.update()
    bar.close()
    plain = statistics.median(t / s for t, s, _ in results["plain"])
    table = []
    for config in CONFIGS:
        rates = [t / s for t, s, _ in results[config]]
        infos = [i for _, _, i in results[config]]
        drafted = sum(i["drafted"] for i in infos)
        table.append([config, f"{statistics.median(rates):.1f}", f"{min(rates):.1f}–{max(rates):.1f}",
                      f"{statistics.median(rates) / plain:.2f}×",
                      f"{sum(i['accepted'] for i in infos) / drafted:.2f}" if drafted and config != "plain" else "–",
                      drafted // args.rounds if config != "plain" else "–",
                      "/".join(str(i["losses"]) for i in infos) if config.startswith("adaptive") else "–"])
    body = "\n".join([
        f"{args.requests} chat prompts, outputs {args.min_tokens}–{args.max_tokens} tokens (EOS ignored), "
        f"at most {args.batch} running (requests are admitted as others finish), T = {args.temperature}, "
        f"K = {args.k} (adaptive: the cap); one engine, {args.rounds} interleaved rounds after an untimed "
        f"warm-up; adaptive rows start from fresh adaptive state every round. torch threads "
        f"{torch.get_num_threads()}; load average (1 min) before {load_before:.2f}, after "
        f"{os.getloadavg()[0]:.2f}.",
        "",
        markdown_table(["configuration", "tok/s (median)", "spread", "vs plain", "acceptance",
                        "drafted per round", "guard verdicts per round"], table),
    ])
    print(body)
    if not args.no_write:
        update_section("speculative_stream", "Speculative sampling on a stream of short requests: adaptive K with "
                       "and without its outcome guard (issue 19)", body)


if __name__ == "__main__":
    main()
