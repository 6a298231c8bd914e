"""Measure a draft against its target offline: the acceptance speculative decoding would see.

At temperature 0 speculative decoding accepts a draft token exactly when it equals the
target's greedy token, and every accepted draft token was conditioned on the target's own
prefix -- so running the target greedily once and reading the draft's argmax at every
position of that text (one teacher-forced pass) gives the exact accept/reject sequence, from
which tokens per target forward follow for any K. At temperature T the per-token acceptance
probability is ``sum_x min(p_T(x), q_T(x))``, read at the same positions.

Also measured, for the lever after a better draft: how often the target's token is among the
draft's top k (``top_k_agreement``), and the tokens per target forward of greedy speculation
over a *tree* of drafts (``simulate_tree``: after each accepted node, the draft's top w tokens
as children) -- what verifying several candidates per position in one target pass would give
this draft (the engine verifies both, ``speculative_tree``). And how well the draft knows when
it is right: its greedy acceptance by its own peak probability (``calibration``), and the tokens
per target forward of chains that end where that peak falls below a threshold
(``simulate_confident``; the engine's ``draft_confidence_threshold``).

    python -m keyserve.training.acceptance --draft drafts/SmolLM2-135M-Instruct-draft
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch

from keyserve.engine.draft_chain import max_probability
from keyserve.model.draft_model import load_draft
from keyserve.model.loader import LoadedModel, load_model
from keyserve.training.dense import DenseLlama
from keyserve.training.generate import GenerationJob, generate_answers
from keyserve.training.prompts import BENCH_PROMPTS, HELD_OUT_PROMPTS
from keyserve.training.records import Answer
from keyserve.training.teacher_forced import teacher_forced_logits

CHAT_PROMPTS = HELD_OUT_PROMPTS  # kept out of distill-draft's prompt set
# --prompts: the held-out chat prompts (the draft's measure), or bench/spec_bench.py's 16 (what the
# engine bench decodes; kept out of the wide prompt set only)
PROMPT_CHOICES = {"held-out": HELD_OUT_PROMPTS, "bench": BENCH_PROMPTS}


@dataclass
class AcceptanceReport:
    prompts: int
    positions: int
    greedy_acceptance: float  # P(draft argmax == target argmax) on the target's greedy text
    tokens_per_target_forward: dict[int, float]  # K -> mean tokens per verification at T = 0
    sampled_acceptance: dict[float, float]  # T -> mean sum_x min(p_T, q_T) on the same text
    top_k_agreement: dict[int, float]  # k -> P(target's greedy token among the draft's top k)
    # tree shape "w1xw2x..." (children per node at each depth) -> (target rows per verification
    # besides the last accepted token's: the tree's nodes, tokens per target forward)
    tree_tokens_per_target_forward: dict[str, tuple[int, float]]
    # the draft's peak probability in [lo, hi) -> (share of positions, greedy acceptance there)
    calibration: dict[str, tuple[float, float]]
    # "K@threshold" -> (drafts verified per target forward, tokens per target forward) of greedy
    # chains of up to K that end where the draft's peak falls below the threshold
    confident_tokens_per_target_forward: dict[str, tuple[float, float]]


def simulate_greedy(agree: list[bool], k: int) -> float:
    """Tokens per target forward of greedy speculative decoding with ``k`` drafts, given
    whether the draft's argmax matches the target's at each position of the target's text: a
    tree of one child per depth (``simulate_tree``, rank 0 where they agree)."""
    return simulate_tree([0 if a else 1 for a in agree], (1,) * k)


TREES = ((2,), (3,), (2, 1), (3, 1), (2, 2), (3, 2), (3, 2, 1), (4, 2, 1))


def simulate_tree(ranks: list[int], widths: tuple[int, ...]) -> float:
    """Tokens per target forward of greedy speculation verifying a full tree of drafts: at
    depth d every node has the draft's ``widths[d]`` likeliest next tokens as children. Given
    the rank of the target's token in the draft's distribution at each position of the
    target's text (the draft conditioned on the target's own prefix -- the tree's accepted path),
    depth d is accepted while that rank is below ``widths[d]``. ``widths = (1,) * k`` is a chain
    of k drafts (``simulate_greedy``)."""
    pos, forwards, n = 0, 0, len(ranks)
    while pos < n:
        depth = 0
        while depth < len(widths) and pos + depth < n and ranks[pos + depth] < widths[depth]:
            depth += 1
        pos += depth + 1  # the accepted drafts plus the target's own token
        forwards += 1
    return n / max(forwards, 1)


CALIBRATION_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0)
CONFIDENT_CHAINS = ((3, 0.0), (3, 0.3), (6, 0.3), (8, 0.3), (6, 0.5), (8, 0.5), (4, 0.8))


def simulate_confident(agree: list[bool], peaks: list[float], k: int, threshold: float) -> tuple[float, float]:
    """(Drafts verified, tokens) per target forward of greedy chains of up to ``k`` drafts that
    end before the first position whose draft peak probability is below ``threshold``. Along
    the target's text the draft's context is the target's own until the first rejection; past
    it the chain's real drafts would follow the draft's own tokens, which this text does not
    hold, so a chain is counted as ending at its first rejection: the drafts column is a lower
    bound (the tokens column is exact)."""
    pos, forwards, drafts, n = 0, 0, 0, len(agree)
    while pos < n:
        depth = 0
        while depth < k and pos + depth < n and peaks[pos + depth] >= threshold:
            drafts += 1
            if not agree[pos + depth]:
                break
            depth += 1
        pos += depth + 1
        forwards += 1
    return drafts / max(forwards, 1), n / max(forwards, 1)


def calibration(agree: list[bool], peaks: list[float]) -> dict[str, tuple[float, float]]:
    """Share of positions and greedy acceptance in each bin of the draft's peak probability."""
    out = {}
    for lo, hi in zip(CALIBRATION_BINS, CALIBRATION_BINS[1:]):
        inside = [a for a, p in zip(agree, peaks) if lo <= p < hi or (hi == 1.0 and p == 1.0)]
        out[f"{lo:.1f}-{hi:.1f}"] = (len(inside) / max(len(agree), 1), sum(inside) / max(len(inside), 1))
    return out


def tree_nodes(widths: tuple[int, ...]) -> int:
    """Draft tokens a full tree of these widths holds: the target rows it adds to a step."""
    total, level = 0, 1
    for w in widths:
        level *= w
        total += level
    return total


def _chat_ids(target: LoadedModel, text: str) -> list[int]:
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def greedy_chat_answers(target: LoadedModel, prompts: list[str], max_new_tokens: int) -> list[Answer]:
    """The target's greedy answers to chat prompts, in prompt order: the text every
    acceptance measure reads the draft along."""
    ids = [_chat_ids(target, p) for p in prompts]
    eos = {int(e) for e in target.config.eos_token_ids} | {int(target.tokenizer.eos_token_id)}
    job = GenerationJob(ids, [0.0] * len(ids), list(range(len(ids))), max_new_tokens, eos, top_k=1,
                        slots=len(ids))
    answers: list[Answer] = []
    generate_answers(DenseLlama.from_serving(target.model), job, float("inf"), answers.extend)
    return sorted(answers, key=lambda a: a.prompt_index)


def _overlap(
    draft_logits: torch.Tensor,  # [n, vocab]
    target_logits: torch.Tensor,  # [n, vocab]
    temperature: float,
) -> float:
    p = torch.softmax(draft_logits / temperature, -1)
    q = torch.softmax(target_logits / temperature, -1)
    return float(torch.minimum(p, q).sum(-1).mean())


@torch.inference_mode()
def measure(
    target: LoadedModel,
    draft: LoadedModel,
    prompts: list[str],
    max_new_tokens: int = 128,
    ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8),
    temperatures: tuple[float, ...] = (0.8, 1.0),
) -> AcceptanceReport:
    agree_all: list[list[bool]] = []
    peaks_all: list[list[float]] = []  # the draft's peak probability at T = 1 at each position
    ranks_all: list[list[int]] = []
    overlaps: dict[float, list[float]] = {t: [] for t in temperatures}
    for a in greedy_chat_answers(target, prompts, max_new_tokens):
        seq = a.prompt + a.tokens
        rows = slice(len(a.prompt) - 1, len(seq) - 1)  # positions predicting the answer
        d_logits = teacher_forced_logits(draft.model, seq)[rows]
        t_logits = teacher_forced_logits(target.model, seq)[rows]
        agree_all.append((d_logits.argmax(-1) == torch.tensor(a.tokens)).tolist())
        peaks_all.append(max_probability(d_logits).tolist())
        chosen = d_logits.gather(1, torch.tensor(a.tokens)[:, None])  # [n, 1]
        ranks_all.append((d_logits > chosen).sum(-1).tolist())  # 0: the draft's argmax
        for t in temperatures:
            overlaps[t].append(_overlap(d_logits, t_logits, t) * len(a.tokens))
    positions = sum(len(a) for a in agree_all)
    return AcceptanceReport(
        prompts=len(prompts),
        positions=positions,
        greedy_acceptance=sum(sum(a) for a in agree_all) / max(positions, 1),
        tokens_per_target_forward={
            k: sum(simulate_greedy(a, k) * len(a) for a in agree_all) / max(positions, 1) for k in ks
        },
        sampled_acceptance={t: sum(v) / max(positions, 1) for t, v in overlaps.items()},
        top_k_agreement={k: sum(r < k for rs in ranks_all for r in rs) / max(positions, 1) for k in (1, 2, 3, 4, 8)},
        tree_tokens_per_target_forward={
            "x".join(map(str, w)): (tree_nodes(w), sum(simulate_tree(r, w) * len(r) for r in ranks_all) / max(positions, 1))
            for w in TREES
        },
        calibration=calibration([x for a in agree_all for x in a], [x for p in peaks_all for x in p]),
        confident_tokens_per_target_forward=_confident_report(agree_all, peaks_all, positions),
    )


def _confident_report(agree_all: list[list[bool]], peaks_all: list[list[float]],
                      positions: int) -> dict[str, tuple[float, float]]:
    """``simulate_confident`` at each of CONFIDENT_CHAINS, over every prompt's answer (each
    weighted by its positions, as the other measures)."""
    out = {}
    for k, t in CONFIDENT_CHAINS:
        per = [simulate_confident(a, p, k, t) for a, p in zip(agree_all, peaks_all)]
        out[f"{k}@{t:g}"] = (sum(d * len(a) for (d, _), a in zip(per, agree_all)) / max(positions, 1),
                             sum(x * len(a) for (_, x), a in zip(per, agree_all)) / max(positions, 1))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", default=None)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", choices=list(PROMPT_CHOICES), default="held-out",
                        help="held-out: the 10 chat prompts no training run sees (the draft's measure); "
                             "bench: the speculative bench's 16 prompts")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_model(args.target, progress=False)
    draft = load_draft(args.draft, target)
    report = measure(target, draft, PROMPT_CHOICES[args.prompts], args.max_tokens)
    print(json.dumps(asdict(report), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
