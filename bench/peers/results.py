"""The peer bench's arithmetic, free of timing and processes: which rounds count, the summary of
each contender over them, the bandwidth bound, the ratios, and whether each target was met."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

# Issue 18's targets.
DECODE_BOUND_FRACTION = 0.85  # batch-1 decode ≥ 85 % of the bandwidth bound
SERVER_RATIO = 1.5  # many requests: keyserve ≥ 1.5 × llama-server
TRANSFORMERS_RATIO = 5.0  # many requests: keyserve ≥ 5 × transformers' padded batches (and, stricter, its best way)


@dataclass
class Round:
    """One interleaved round: the bandwidth and each contender's worker result."""

    index: int
    bandwidth_gbs: float
    bandwidth_by_pages: dict[str, float] = field(default_factory=dict)  # "4k" / "huge" -> GB/s
    loads: list[float] = field(default_factory=list)  # every 1-min load read before a measurement
    results: list[dict] = field(default_factory=list)  # worker.measure() dicts

    @property
    def max_load(self) -> float:
        return max(self.loads) if self.loads else 0.0


def split_rounds(rounds: list[Round], max_load: float) -> tuple[list[Round], list[Round]]:
    """Rounds whose every measurement started at a 1-min load ≤ ``max_load``, and the others."""
    kept = [r for r in rounds if r.max_load <= max_load]
    return kept, [r for r in rounds if r.max_load > max_load]


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float
    n: int

    def text(self, digits: int = 1) -> str:
        if round(self.low, digits) == round(self.high, digits):
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} ({self.low:.{digits}f}–{self.high:.{digits}f})"


    def percent(self) -> str:
        lo, hi = round(self.low * 100), round(self.high * 100)
        return f"{self.median:.0%}" if lo == hi else f"{self.median:.0%} ({lo}–{hi} %)"


def spread(values: list[float]) -> Spread | None:
    if not values:
        return None
    return Spread(statistics.median(values), min(values), max(values), len(values))


def contender(engine: str, precision: str) -> str:
    return f"{engine} {precision}"


def summarize(rounds: list[Round], bytes_per_token: dict[str, int]) -> dict[str, dict[str, Spread | None]]:
    """Per contender (``"keyserve float32"``): decode and prefill tok/s over the rounds, and the
    decode's fraction of that round's bandwidth bound (bandwidth ÷ bytes of weights per token of
    its precision), as median (low–high). ``bytes_per_token`` is keyed by precision."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in rounds:
        for res in r.results:
            key = contender(res["engine"], res["precision"])
            d = out.setdefault(key, {"decode": [], "prefill": [], "bound": [], "fraction": []})
            d["decode"].append(res["decode_tok_s"])
            d["prefill"].append(res["prefill_tok_s"])
            nbytes = bytes_per_token.get(res["precision"])
            if nbytes:
                bound = r.bandwidth_gbs * 1e9 / nbytes
                d["bound"].append(bound)
                d["fraction"].append(res["decode_tok_s"] / bound)
    return {k: {m: spread(v) for m, v in d.items()} for k, d in out.items()}


@dataclass(frozen=True)
class Target:
    what: str
    goal: str
    measured: str
    met: bool | None  # None: not measured in this run

    @property
    def verdict(self) -> str:
        return {True: "met", False: "**missed**", None: "not measured"}[self.met]


# keyserve's precision -> the llama.cpp GGUF precision compared with it
SAME_PRECISION = {"float32": "F32", "bfloat16": "BF16"}


def decode_targets(summary: dict, precisions: list[str]) -> list[Target]:
    """Batch-1 decode ≥ 85 % of the bound, ≥ llama.cpp; prefill ahead of llama.cpp; per precision."""
    targets = []
    for p in precisions:
        ks = summary.get(contender("keyserve", p), {})
        lc = summary.get(contender("llama.cpp", SAME_PRECISION.get(p, p)), {})
        frac = ks.get("fraction")
        targets.append(Target(f"keyserve {p} batch-1 decode vs the bandwidth bound", f"≥ {DECODE_BOUND_FRACTION:.0%}",
                              f"{frac.median:.0%}" if frac else "—", frac.median >= DECODE_BOUND_FRACTION if frac else None))
        for metric, what in (("decode", "batch-1 decode"), ("prefill", "prefill")):
            a, b = ks.get(metric), lc.get(metric)
            ratio = a.median / b.median if a and b else None
            targets.append(Target(f"keyserve {p} {what} vs llama.cpp {SAME_PRECISION.get(p, p)}", "≥ 1.00×",
                                  f"{ratio:.2f}×" if ratio else "—", ratio >= 1.0 if ratio else None))
    return targets


def throughput_targets(tput: dict[str, dict[str, float | None]], precisions: list[str]) -> list[Target]:
    """``tput[precision]`` has ``keyserve``, ``llama-server``, ``transformers`` (its best way)
    useful tok/s, and ``transformers padded`` where the padded way ran: the issue's own target is
    against padded batches; the best way is the stricter comparison, shown beside it."""
    targets = []
    for p in precisions:
        row = tput.get(p, {})
        peers = [("llama-server", SERVER_RATIO)]
        peers += [("transformers padded", TRANSFORMERS_RATIO)] if "transformers padded" in row else []
        peers += [("transformers", TRANSFORMERS_RATIO)]
        for peer, goal in peers:
            r = ratio(row.get("keyserve"), row.get(peer))
            targets.append(Target(f"{p}: many requests, keyserve / {peer}", f"≥ {goal:.1f}×",
                                  f"{r:.2f}×" if r else "—", r >= goal if r else None))
    return targets


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def useful_tok_s(tokens_done: int, elapsed_s: float) -> float | None:
    """Generated tokens per second over the time the contender ran (None if it did nothing)."""
    return tokens_done / elapsed_s if tokens_done and elapsed_s > 0 else None


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def rotation(items: list, index: int) -> list:
    """``items`` started at ``index`` (mod len): round i runs the contenders in this order."""
    if not items:
        return []
    k = index % len(items)
    return items[k:] + items[:k]
