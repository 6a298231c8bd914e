"""Speculative sampling on SmolLM2-135M-Instruct with the committed distilled draft.

Side by side in one process: keyserve without speculation, keyserve with the draft at
K = 1..6, keyserve with adaptive K (capped at the largest K; it may pick K = 0; switched on
for its rows in the same engine, see ``adaptive_k``), and
transformers' assisted generation (``generate(..., assistant_model=draft)``, a constant K) with
the very same draft weights (``keyserve.training.hf.draft_for_transformers``), at temperature 0
and 0.8, batch 1 and batch 8 (transformers' assisted generation takes one sequence at a time,
so it has batch-1 rows only). Every output is forced to its length (EOS ignored) on both sides.
With ``--ray`` also the Ray engine (TP = 1, its default step path) at batch 1: one without a draft
(its own plain decoding) and one with the draft actor at each K and adaptive K, taking their
turns in the same rounds (the ``ray`` rows; their speed-up is over the Ray engine's plain row).
With ``--trees`` also trees of drafts of each shape (``speculative_tree``), fixed and with
adaptive K (per sequence the tree or plain decoding), in process and, with ``--ray``, on the
Ray engine's draft actor. With ``--lookups N`` every in-process chain row (fixed and adaptive K)
runs a second time with prompt lookup first (``prompt_lookup_max`` N, ``--lookup-min``: drafts
copied from earlier in the sequence where its last n tokens occurred before, the draft model
elsewhere), on the same engine. With ``--ngram N`` every such row runs again speculating by
prompt lookup alone (``draft="ngram"``: no draft model; the "keyserve ngram" rows), the engine's
speculative policy swapped for an ngram one for those runs (``lookup_alone``). With
``--confidences T`` also fixed-K chains (K from ``--confident-ks``) that end where the draft's own
distribution peaks below T (``draft_confidence_threshold``), alone and with each lookup.

So that a reader can trust it: every configuration runs the same ``--num-prompts`` prompts
(16 distinct by default) x ``--max-tokens`` (128); every contender gets an untimed warm-up of
every configuration first (keyserve, keyserve adaptive and transformers alike); then
``--rounds`` (3) interleaved rounds, each running every configuration once, in reverse order on
odd rounds, so a slow drift of the machine's load hits every contender alike; within a round,
``--slices`` (4): every configuration runs on a quarter of its prompt batches, then every
configuration on the next quarter (the order reversed each time), because a run on the 2-core
EPYC (2026-12-02) sped up by half within its 38 minutes, and a configuration's 16 prompts at
batch 1 take over a minute. Reported: the
median over rounds and the spread (min-max) of tokens/s.

Reported per row: generated tokens/s over the wall time of the generate calls (prefill
included, the same for every contender), acceptance rate (accepted / drafted), tokens per
target forward, and the speed-up over keyserve's own non-speculative decoding at the same batch
and temperature (ratio of medians). For transformers the counts come from forward hooks on both
models (accepted = generated − target forwards after the first; drafted = draft forwards).

    python bench/spec_bench.py [--ks 1 2 3 4 5 6] [--num-prompts 16] [--max-tokens 128] [--rounds 3] [--slices 4]

Writes the "speculative" section of docs/BENCHMARKS.md and docs/bench_spec.png.

With ``--step-cost`` it measures the step cost model instead (issue 19): the time of one
decode step, plain and speculative at each K, on the same engine in interleaved rounds, split
into draft, target forward, verify/sample and bookkeeping, against the target
``speculative step <= 1.1 x (1 + c K) x plain step`` with c the measured cost of one draft
forward over one target forward. Writes the "speculative_step_cost" section and
docs/bench_spec_step.json:

    python bench/spec_bench.py --step-cost --batches 1 8 --ks 1 4 --max-tokens 32 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.report import BENCHMARKS_MD, command_line, markdown_table, update_section  # noqa: E402
from keyserve.training.prompts import BENCH_PROMPTS  # noqa: E402

DOCS = BENCHMARKS_MD.parent
PROMPTS = BENCH_PROMPTS  # kept out of distill-draft's wide prompt set (training/prompts.py)
# issue 19, one run: batch 1 T = 0 >= 1.8x plain keyserve, T = 0.8 >= 1.4x, batch 8 >= 1.1x
TARGETS = {(1, 0.0): 1.8, (1, 0.8): 1.4, (8, 0.0): 1.1, (8, 0.8): 1.1}
SECTION_TITLES = {"speculative_ray": "Speculative sampling on the Ray engine: the draft actor against its own plain "
                  "decoding (issue 19)",
                  "speculative_tree": "Speculative sampling: trees of drafts against chains (issue 19)",
                  "speculative_guard": "Speculative sampling: adaptive K with the outcome guard (issue 19)",
                  "speculative_lookup": "Speculative sampling: prompt lookup before the draft model (issue 19)",
                  "speculative_ngram": "Speculative sampling without a draft model: prompt lookup alone (issue 19)",
                  "speculative_lookup_aware": "Speculative sampling: lookup-aware adaptive K, copies chosen apart "
                  "from the draft model (issue 19)",
                  "speculative_lookup_aware_b8": "Speculative sampling: lookup-aware adaptive K at batch 8, after "
                  "the step-cost fix (issue 19)",
                  "speculative_tiles": "Speculative sampling on the AVX2 float32 register tiles: verify rows "
                  "cheaper (issue 19)",
                  "speculative_run5": "Speculative sampling with draft run 5, all four targets in one run (issue 19, "
                  "the Zen 5)",
                  "speculative_run5_eos": "Speculative sampling with draft run 5, answers ending at their EOS (issue "
                  "19, the Zen 5)",
                  "speculative_ray_run5": "Speculative sampling on the Ray engine with draft run 5 (issue 19, the "
                  "Zen 5)",
                  "speculative_run6": "Speculative sampling with draft run 6, all four targets in one run (issue 19, "
                  "the Zen 5)",
                  "speculative_ray_run6": "Speculative sampling on the Ray engine with draft run 6 (issue 19, the "
                  "Zen 5)",
                  "speculative_confidence": "Speculative sampling: chains that end where the draft doubts "
                  "(issue 19, the Zen 5)",
                  "speculative_run7": "Speculative sampling with draft run 7, batch 1 (issue 19, the Zen 5)",
                  "speculative_run8": "Speculative sampling with draft run 8 (the wide prompt set), all four targets "
                  "in one run (issue 19, the Zen 5)",
                  "speculative_ray_run8": "Speculative sampling on the Ray engine with draft run 8 (issue 19, the "
                  "Zen 5)"}
RAY_TARGETS = {0.0: 1.5}  # issue 19: the Ray engine with the draft actor, batch 1, over its own plain decoding


@dataclass
class Row:
    engine: str  # "keyserve" | "ray" (the Ray engine, TP = 1) | "transformers"
    batch: int
    temperature: float
    k: int  # 0 = no speculation
    tokens: int
    seconds: float
    drafted: int = 0
    accepted: int = 0
    target_forwards: int = 0
    adaptive: bool = False  # keyserve with adaptive K, k the cap
    repeat: int = 0  # which interleaved round
    tree: str = ""  # keyserve verifying a tree of drafts of this shape (speculative_tree; k = 0)
    lookup: int = 0  # prompt lookup's largest n-gram (prompt_lookup_max; 0: the draft model alone)
    lookup_drafted: int = 0  # drafts that prompt lookup made (the rest the draft model's)
    lookup_accepted: int = 0  # of them, accepted (the engine's ``SpeculativeDecoder.lookup_stats``)
    confidence: float = 0.0  # draft_confidence_threshold: chains end where the draft doubts (0: off)

    def merged(self, other: "Row") -> "Row":
        """This row and another part of the same round of the same contender, as one."""
        out = Row(**asdict(self))
        for name in ("tokens", "seconds", "drafted", "accepted", "target_forwards", "lookup_drafted",
                     "lookup_accepted"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    @property
    def contender(self) -> tuple:
        """What the row measures, whatever the round."""
        return (self.engine, self.adaptive, self.batch, self.temperature, self.k, self.tree, self.lookup,
                self.confidence)

    @property
    def plain(self) -> bool:
        """No speculation: the row every speed-up is measured against."""
        return self.k == 0 and not self.tree

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_forward(self) -> float | None:
        return self.tokens / self.target_forwards if self.target_forwards else None


# ------------------------------------------------------------------------ keyserve
def keyserve_run(llm, batch: int, temperature: float, k: int, prompts: list[str], max_tokens: int,
                 adaptive: bool = False, tree: str = "", lookup: int = 0, engine: str = "",
                 ignore_eos: bool = True, confidence: float = 0.0) -> Row:
    from keyserve import SamplingParams

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos, seed=i,
                              speculative=k > 0 or bool(tree), num_speculative_tokens=k or None)

    ray = hasattr(llm.engine, "core_client")  # RayEngine: built without prefix caching instead
    if not ray:
        llm.engine.block_manager.reset_prefix_cache()
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    row = Row(engine or ("ray" if ray else "keyserve"), batch, temperature, k, 0, 0.0, adaptive=adaptive, tree=tree,
              lookup=lookup, confidence=confidence)
    drafter = getattr(llm.engine.speculative, "drafter", None)
    looked_before = getattr(drafter, "lookup_tokens", 0)
    copies = getattr(llm.engine.speculative, "lookup_stats", None)
    copies_accepted = copies.num_accepted_tokens if copies is not None else 0
    for group in groups:
        t = time.perf_counter()
        outs = llm.generate(group, [params(i) for i in range(len(group))], chat=True)
        row.seconds += time.perf_counter() - t
        for out in outs:
            s = out.stats
            row.tokens += s.generated_tokens
            row.drafted += s.spec_draft_tokens
            row.accepted += s.spec_accepted_tokens
            if s.spec_tokens_per_forward:
                row.target_forwards += round(s.generated_tokens / s.spec_tokens_per_forward)
            else:
                row.target_forwards += s.generated_tokens
    row.lookup_drafted = getattr(drafter, "lookup_tokens", 0) - looked_before
    row.lookup_accepted = (copies.num_accepted_tokens - copies_accepted) if copies is not None else 0
    return row


@contextlib.contextmanager
def adaptive_k(llm, on: bool):  # noqa: ANN001, ANN201
    """Adaptive K switched on for one run of the engine that runs every keyserve row.

    Why one engine: a second LLM in the same process decoded ~8-10 % slower at batch 8 on the
    2-core Xeon (plain decoding on both, either order; docs/speculative.md, "Adaptive K"), and
    the adaptive rows, run on a second engine, read that as adaptive K's cost. The
    step cost model learns only while adaptive K is on (``SpeculativeDecoder.observe_step``), over
    the warm-up and every round, as a server's would; the engine's acceptance prior sees every
    verification, fixed K included, as a server's would."""
    policy = llm.engine.speculative
    if policy is None:  # an engine without a draft (the Ray engine's plain rows)
        assert not on
        yield
        return
    before = policy.config
    if on:
        policy.config = before.model_copy(update={"adaptive_k": True})
    try:
        yield
    finally:
        policy.config = before


_NGRAM_POLICIES: dict[tuple[int, int, int], object] = {}


@contextlib.contextmanager
def lookup_alone(llm, max_n: int, min_n: int):  # noqa: ANN001, ANN201
    """The engine speculating by prompt lookup alone (``draft="ngram"``, ``LookupDrafter``) for
    one run: its speculative policy and drafter swapped for an ngram one, kept across runs (its
    step-cost model and acceptance learn over the warm-up and every round, as a server's
    would). Same engine, same target, as every other keyserve row."""
    from keyserve.engine.lookup_drafter import LookupDrafter
    from keyserve.engine.speculative import SpeculativeDecoder

    engine = llm.engine
    before = engine.speculative, engine.drafter
    key = (id(llm), min_n, max_n)
    policy = _NGRAM_POLICIES.get(key)
    if policy is None:
        config = before[0].config.model_copy(update={"draft": "ngram", "prompt_lookup_max": max_n,
                                                     "prompt_lookup_min": min_n})
        drafter = LookupDrafter(engine.vocab_size, (min_n, max_n))
        policy = _NGRAM_POLICIES[key] = SpeculativeDecoder(drafter, config, cost_ratio=0.0)
    engine.speculative, engine.drafter = policy, policy.drafter
    try:
        yield
    finally:
        engine.speculative, engine.drafter = before


@contextlib.contextmanager
def prompt_lookup(llm, max_n: int, min_n: int):  # noqa: ANN001, ANN201
    """The in-process drafter drafting by prompt lookup (n-grams min_n..max_n) first for one
    run, the draft model alone otherwise: one engine for every keyserve row, as for
    ``adaptive_k``."""
    policy = llm.engine.speculative
    index = getattr(getattr(policy, "drafter", None), "lookup_index", None)
    if index is None:  # no draft, or the Ray engine's actor
        assert not max_n
        yield
        return
    indexes = (index, policy.matches)  # the drafter's, and adaptive K's (lookup-aware K)
    before = [i.sizes for i in indexes]
    for i in indexes:
        i.sizes = (min_n, max_n) if max_n else None
        i.clear()
    try:
        yield
    finally:
        for i, sizes in zip(indexes, before):
            i.sizes = sizes
            i.clear()


@contextlib.contextmanager
def draft_confidence(llm, threshold: float):  # noqa: ANN001, ANN201
    """The in-process drafter ending its chains where its own distribution peaks below
    ``threshold`` (``draft_confidence_threshold``) for one run, 0 otherwise: one engine for every
    keyserve row, as for ``adaptive_k``."""
    drafter = getattr(llm.engine.speculative, "drafter", None)
    if not threshold:
        yield
        return
    before = drafter.confidence
    drafter.confidence = threshold
    try:
        yield
    finally:
        drafter.confidence = before


@contextlib.contextmanager
def tree_shape(llm, shape: str):  # noqa: ANN001, ANN201
    """The engine verifying trees of this shape for one run (``speculative_tree``), chains
    otherwise: one engine for every keyserve row, as for ``adaptive_k``."""
    from keyserve.core.spec_tree import TreeShape

    policy = llm.engine.speculative
    if not shape or policy is None:
        yield
        return
    before = policy.config, policy.tree
    policy.config = before[0].model_copy(update={"speculative_tree": shape})
    policy.tree = TreeShape.parse(shape)
    try:
        yield
    finally:
        policy.config, policy.tree = before


# -------------------------------------------------------------------- transformers
class ForwardCounter:
    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        module.register_forward_hook(self._hook)

    def _hook(self, *_: object) -> None:
        self.calls += 1


def hf_run(target, draft, counters, tok, temperature: float, k: int, prompts: list[str],
           max_tokens: int, ignore_eos: bool = True) -> Row:
    from transformers import GenerationConfig

    t_count, d_count = counters
    row = Row("transformers", 1, temperature, k, 0, 0.0)
    for i, prompt in enumerate(prompts):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        cfg = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens if ignore_eos else None,
                               do_sample=temperature > 0, temperature=temperature or None, top_k=None,
                               top_p=None, pad_token_id=tok.eos_token_id)
        kw = {}
        if k:
            # The candidate generator reads these from the *assistant's* generation config.
            draft.generation_config.num_assistant_tokens = k
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            draft.generation_config.assistant_confidence_threshold = 0.0
            kw["assistant_model"] = draft
        torch.manual_seed(i)
        t_before, d_before = t_count.calls, d_count.calls
        t = time.perf_counter()
        out = target.generate(ids, generation_config=cfg, **kw)
        row.seconds += time.perf_counter() - t
        n = out.shape[1] - ids.shape[1]
        row.tokens += n
        forwards = t_count.calls - t_before
        row.target_forwards += forwards
        if k:
            row.drafted += d_count.calls - d_before
            row.accepted += max(0, n - forwards)
    return row


# ---------------------------------------------------------------------- step cost
STEP_COST_SLACK = 1.1  # issue 19: spec step <= 1.1 x (1 + c K) x plain step
PHASES = ("draft", "target", "verify/sample", "bookkeeping")


class StepClock:
    """Per-step phase times of one engine, by wrapping (on the instances only) the calls a
    step makes: ``drafter.propose`` (draft: its forwards and its own bookkeeping), the target
    runner's ``forward_logits`` (target), ``sample`` + ``_verify`` (verify/sample); the rest
    of ``engine.step`` is bookkeeping (scheduling, stop checks, commit). The draft model's
    forward and LM head are timed too, for the cost ratio c."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.cur: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        runner, drafter = engine.runner, engine.drafter
        self._wrap(runner, "forward_logits", "target")
        self._wrap(runner, "sample", "verify/sample")
        self._wrap(runner, "_verify", "verify/sample")
        self._wrap(runner, "execute", "execute", self._note_step)
        if drafter is not None:
            self._wrap(drafter, "propose", "draft")
            # the draft's forwards go through the runner or, chained, to the model directly
            # (engine/draft_chain.py): its layers and its head, timed either way
            model = drafter.runner.model
            self._wrap(model, "forward", "draft_forward")
            self._wrap(model, "compute_head_logits" if hasattr(model, "compute_head_logits") else "compute_logits",
                       "draft_forward")
        self._wrap(engine, "step", "total", self._close_step, first=True)

    def _note_step(self, step, *_: object) -> None:
        # A step with a prompt chunk (more than one new token) is a prefill, not a decode step.
        if any(len(it.token_ids) > 1 for it in step.items):
            self.cur["prefill"] = 1.0

    def _close_step(self, *_: object) -> None:
        pass

    def _wrap(self, obj, name: str, phase: str, before=None, first: bool = False) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            if first:
                self.cur = {}
            if before is not None:
                before(*args)
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.cur[phase] = self.cur.get(phase, 0.0) + time.perf_counter() - t
                if first:
                    self.steps.append(self.cur)

        setattr(obj, name, timed)

    def reset(self) -> None:
        self.steps = []


@dataclass
class StepCost:
    batch: int
    k: int  # 0 = plain decoding
    steps: int  # steady decode steps measured, all rounds
    tokens_per_step: float  # emitted per sequence per decode step
    total_ms: float  # median decode step
    phases_ms: dict  # phase -> median ms per decode step
    draft_forward_ms: float  # median per draft forward (0 for plain)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return 0.0 if not n else (xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2]))


def step_cost_run(llm, clock: StepClock, batch: int, k: int, max_tokens: int,
                  temperature: float) -> tuple[list[dict[str, float]], float]:
    """Decode ``batch`` prompts together; the phase times of its steady decode steps (the
    prefill step, the draft's prompt catch-up right after it and the last K steps, which draft
    fewer because max_tokens clamps them, left out), and the tokens each sequence emitted per
    decode step."""
    from keyserve import SamplingParams

    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True, seed=i,
                             speculative=k > 0, num_speculative_tokens=k or None) for i in range(batch)]
    llm.engine.block_manager.reset_prefix_cache()
    clock.reset()
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(batch)], params, chat=True)
    decode = [s for s in clock.steps if "prefill" not in s]
    steady = decode[1 if k else 0 : max(2, len(decode) - k)]
    per_seq = sum(o.stats.generated_tokens for o in outs) / batch
    return steady, (per_seq - 1) / max(1, len(decode))


def step_cost(args: argparse.Namespace) -> tuple[list[StepCost], dict]:
    """Interleaved rounds of plain and speculative decoding at each batch; medians per phase
    over the steady steps of every round pooled (robust to a loaded machine's spikes)."""
    from keyserve import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    start, load_before = time.perf_counter(), _load_avg()
    llm = LLM(draft=args.draft, num_speculative_tokens=max(args.ks), max_num_seqs=max(args.batches))
    llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0.0), chat=True)  # warm-up
    clock = StepClock(llm.engine)
    steps: dict[tuple[int, int], list[dict[str, float]]] = {}
    rates: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.rounds):
        for batch in args.batches:
            for k in [0, *args.ks]:
                with torch.inference_mode():
                    got, rate = step_cost_run(llm, clock, batch, k, args.max_tokens, args.temperatures[0])
                steps.setdefault((batch, k), []).extend(got)
                rates.setdefault((batch, k), []).append(rate)
                tqdm.write(f"step cost batch {batch} K={k}: {1e3 * _median([s['total'] for s in got]):.1f} ms/step")
    out = []
    for (batch, k), ss in sorted(steps.items()):
        phases = {}
        for ph in PHASES:
            if ph == "bookkeeping":
                vals = [s["total"] - sum(s.get(q, 0.0) for q in PHASES[:3]) for s in ss]
            else:
                vals = [s.get(ph, 0.0) for s in ss]
            phases[ph] = 1e3 * _median(vals)
        forwards = [s["draft_forward"] / k for s in ss if k and "draft_forward" in s]
        out.append(StepCost(batch, k, len(ss), _median(rates[(batch, k)]), 1e3 * _median([s["total"] for s in ss]),
                            phases, 1e3 * _median(forwards)))
    meta = dict(rounds=args.rounds, max_tokens=args.max_tokens, temperature=args.temperatures[0],
                threads=torch.get_num_threads(), load_before=load_before, load_after=_load_avg(),
                wall_min=(time.perf_counter() - start) / 60, command=command_line())
    return out, meta


def render_step_cost(rows: list[StepCost], meta: dict, baseline: dict | None = None) -> str:
    """The table, and (``baseline``: another run's saved json, e.g. before a change) the step
    times of that run beside this one's."""
    plain = {r.batch: r for r in rows if r.k == 0}
    table, verdicts = [], []
    for r in rows:
        p = plain[r.batch]
        c = r.draft_forward_ms / p.phases_ms["target"] if r.k and p.phases_ms["target"] else 0.0
        bound = STEP_COST_SLACK * (1 + c * r.k) * p.total_ms
        ok = r.total_ms <= bound
        # What the step adds over plain: K draft forwards (the model: c·K), the target's K
        # extra rows per sequence (free in the model), and everything else (overhead).
        forwards = r.k * r.draft_forward_ms
        rows_extra = r.phases_ms["target"] - p.phases_ms["target"]
        overhead = r.total_ms - p.total_ms - forwards - rows_extra
        table.append([r.batch, r.k or "plain", r.steps, f"{r.total_ms:.1f}",
                      *(f"{r.phases_ms[ph]:.1f}" for ph in PHASES),
                      f"{r.total_ms / p.total_ms:.2f}×",
                      f"{c:.3f}" if r.k else "–", f"{bound:.1f}" if r.k else "–",
                      ("**met**" if ok else "**NOT met**") if r.k else "–",
                      f"{forwards:.1f}" if r.k else "–", f"{rows_extra:+.1f}" if r.k else "–",
                      f"{overhead:+.1f}" if r.k else "–", f"{r.tokens_per_step:.2f}"])
        if r.k:
            verdicts.append(ok)
    met = sum(verdicts)
    before = []
    if baseline is not None:
        base = {(r["batch"], r["k"]): r for r in baseline["rows"]}
        for r in rows:
            b = base.get((r.batch, r.k))
            if b:
                before.append([r.batch, r.k or "plain", f"{b['total_ms']:.1f}", f"{b['phases_ms']['draft']:.1f}",
                               f"{b['phases_ms']['target']:.1f}", f"{b['phases_ms']['verify/sample']:.1f}",
                               f"{r.total_ms:.1f}", f"{r.total_ms / b['total_ms']:.2f}×"])
    compare = [] if not before else [
        "",
        f"Before and after, the same command and machine ({baseline['meta'].get('label', 'baseline')}; its load "
        f"average before {baseline['meta']['load_before']}, after {baseline['meta']['load_after']}):",
        "",
        markdown_table(["batch", "K", "before: step ms", "before: draft ms", "before: target ms",
                        "before: verify/sample ms", "now: step ms", "now ÷ before"], before),
    ]
    return "\n".join([
        f"Measured with `{meta.get('command', 'python bench/spec_bench.py --step-cost')}`.",
        "",
        f"Per decode step, plain vs speculative, on the same engine (SmolLM2-135M-Instruct, draft "
        f"`default`), temperature {meta['temperature']}, {meta['max_tokens']} generated tokens per "
        f"sequence, {meta['rounds']} interleaved rounds; medians over the steady decode steps of all "
        f"rounds (the prefill step, the draft's prompt catch-up and the last K steps, which draft "
        f"fewer, left out). Phases: draft = `Drafter.propose` (its K forwards and its own "
        f"bookkeeping); target = the target's `forward_logits`; verify/sample = "
        f"`ModelRunner._verify` + `_sample`; bookkeeping = the rest of `LLMEngine.step` (schedule, "
        f"stop checks, commit, runner packing). c = one draft forward ÷ one plain target forward, "
        f"measured. The last columns split what a speculative step adds over a plain one: K draft "
        f"forwards, the target's K extra rows per sequence, and the rest (overhead). torch threads "
        f"{meta['threads']}; load average before {meta['load_before']}, after {meta['load_after']}; "
        f"wall {meta['wall_min']:.1f} min.",
        "",
        f"Target (issue 19): speculative step ≤ {STEP_COST_SLACK} × (1 + c·K) × plain step at the same "
        f"batch — met in {met} of {len(verdicts)} configurations.",
        "",
        markdown_table(["batch", "K", "steps", "step ms", *(f"{ph} ms" for ph in PHASES),
                        "× plain step", "c", f"bound {STEP_COST_SLACK}(1+cK)·plain ms", "target",
                        "K draft forwards ms", "extra target rows ms", "overhead ms",
                        "tokens / step"], table),
        *compare,
    ])

# ------------------------------------------------------------------------ report
@dataclass
class Measured:
    """One contender over every round: tokens/s per round, counts pooled."""

    first: Row  # labels (engine, batch, temperature, K, adaptive)
    tok_s: list[float]
    tokens: int  # per round
    drafted: int
    accepted: int
    target_forwards: int
    lookup_drafted: int = 0
    lookup_accepted: int = 0

    @property
    def median(self) -> float:
        return _median(self.tok_s)

    @property
    def spread(self) -> str:
        return f"{min(self.tok_s):.1f}–{max(self.tok_s):.1f}"

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_forward(self) -> float | None:
        return self.tokens * len(self.tok_s) / self.target_forwards if self.target_forwards else None

    @property
    def label(self) -> str:
        r = self.first
        if r.tree:
            return ("adaptive " if r.adaptive else "") + "tree " + r.tree
        if r.engine == "ngram":  # prompt lookup alone
            return ("adaptive ≤ " if r.adaptive else "") + f"{r.k}, lookup ≤ {r.lookup} alone"
        lookup = f" + lookup ≤ {r.lookup}" if r.lookup else ""
        doubt = f", conf ≥ {r.confidence:g}" if r.confidence else ""
        return ("adaptive ≤ " + str(r.k) if r.adaptive else str(r.k or "off")) + doubt + lookup


def aggregate(rows: list[Row]) -> dict[tuple, Measured]:
    out: dict[tuple, Measured] = {}
    for r in rows:
        m = out.get(r.contender)
        if m is None:
            out[r.contender] = Measured(r, [r.tok_s], r.tokens, r.drafted, r.accepted, r.target_forwards,
                                        r.lookup_drafted, r.lookup_accepted)
        else:
            m.tok_s.append(r.tok_s)
            m.drafted, m.accepted = m.drafted + r.drafted, m.accepted + r.accepted
            m.lookup_drafted += r.lookup_drafted
            m.lookup_accepted += r.lookup_accepted
            m.target_forwards += r.target_forwards
    return out


def _split_acceptance(m: Measured) -> str:
    """Accepted ÷ drafted of prompt lookup's copies and of the draft model's drafts apart
    (runs before the engine counted copies' acceptance show a dash)."""
    model = m.drafted - m.lookup_drafted
    if not m.lookup_accepted and m.lookup_drafted:
        return "–"
    copies = f"{m.lookup_accepted / m.lookup_drafted:.2f}" if m.lookup_drafted else "–"
    own = f"{(m.accepted - m.lookup_accepted) / model:.2f}" if model else "–"
    return f"{copies} / {own}"


def render(rows: list[Row], meta: dict) -> str:
    agg = aggregate(rows)
    ours = [m for m in agg.values() if m.first.engine == "keyserve"]
    theirs = {(m.first.temperature, m.first.k): m for m in agg.values() if m.first.engine == "transformers"}
    base = {(m.first.batch, m.first.temperature): m.median for m in ours if m.first.plain}
    ray_rows = [m for m in agg.values() if m.first.engine == "ray"]
    ray_base = {(m.first.batch, m.first.temperature): m.median for m in ray_rows if m.first.plain}
    table = []
    engines = ("keyserve", "ngram", "ray", "transformers")
    order = lambda m: (m.first.batch, m.first.temperature, engines.index(m.first.engine), m.first.adaptive,  # noqa: E731
                       m.first.k, m.first.tree)
    for m in sorted(agg.values(), key=order):
        r = m.first
        b = (ray_base if r.engine == "ray" else base).get((r.batch, r.temperature))
        hf = theirs.get((r.temperature, r.k)) if r.batch == 1 and r.k and not r.adaptive and not r.tree else None
        table.append([
            ("keyserve ngram" if r.engine == "ngram" else r.engine) + (" adaptive" if r.adaptive else ""),
            r.batch, r.temperature, m.label, m.tokens,
            f"{m.median:.1f}", m.spread,
            f"{m.acceptance:.2f}" if m.acceptance is not None else "–",
            f"{m.tokens_per_forward:.2f}" if m.tokens_per_forward else "–",
            f"{m.median / b:.2f}×" if b else "–",
            f"{m.median / hf.median:.2f}×" if hf and r.engine == "keyserve" else "–",
            f"{m.lookup_drafted / m.drafted:.2f}" if r.lookup and m.drafted else "–",
            _split_acceptance(m) if r.lookup else "–",
        ])
    # The targets count every way keyserve speculates in process, prompt lookup alone included.
    speculating = ours + [m for m in agg.values() if m.first.engine == "ngram"]
    best = _fastest([m for m in speculating if not m.first.plain and not m.first.adaptive],
                    lambda r: (r.batch, r.temperature))
    adaptive_rows = sorted((m for m in speculating if m.first.adaptive),
                           key=lambda m: (m.first.engine, m.first.tree, m.first.k))
    adaptive = _fastest(adaptive_rows, lambda r: (r.batch, r.temperature))  # chains' or a tree's
    hf_best = _fastest([m for m in theirs.values() if m.first.k], lambda r: r.temperature)
    summary, verdicts = [], []
    for (batch, temp), m in sorted(best.items()):
        plain, ad = base[(batch, temp)], adaptive.get((batch, temp))
        hf, hf_plain = (hf_best.get(temp), theirs.get((temp, 0))) if batch == 1 else (None, None)
        summary.append([
            batch, temp, f"{plain:.1f}", f"{m.label if m.first.tree or m.first.lookup or m.first.confidence else 'K=' + str(m.first.k)}: {m.median:.1f}",
            f"{m.median / plain:.2f}×",
            f"{ad.label}: {ad.median:.1f} ({ad.median / plain:.2f}×)" if ad else "–",
            f"{hf_plain.median:.1f}" if hf_plain else "–",
            f"K={hf.first.k}: {hf.median:.1f}" if hf else "–",
            f"{m.median / hf.median:.2f}×" if hf else "–",
            f"{plain / hf_plain.median:.2f}×" if hf_plain else "–",
        ])
        target = TARGETS.get((batch, temp))
        if target is not None:
            # An adaptive row that drafted nothing is plain decoding: its ratio is the rounds' noise,
            # not speculation's gain, so it cannot meet a speed-up target.
            drafted = ad is not None and (ad.tokens_per_forward or 1.0) > 1.0
            got = max(m.median, ad.median if drafted else 0.0) / plain
            verdicts.append(f"batch {batch}, T = {temp}: ≥ {target}× — **{'met' if got >= target else 'NOT met'}** "
                            f"({got:.2f}×" + ("" if drafted or ad is None else
                                              f"; adaptive K drafted nothing, its {ad.median / plain:.2f}× is "
                                              "plain decoding") + ")")
        for each in (a for a in adaptive_rows if (a.first.batch, a.first.temperature) == (batch, temp)):
            verdicts.append(f"adaptive K ({each.label}) never slower than plain, batch {batch}, T = {temp}: "
                            f"**{'met' if each.median >= plain else 'NOT met'}** ({each.median / plain:.2f}×, "
                            f"rounds {each.spread} tok/s against plain "
                            f"{agg[('keyserve', False, batch, temp, 0, '', 0, 0.0)].spread})")
    for temp in sorted({m.first.temperature for m in ray_rows}):
        plain = ray_base.get((1, temp))
        spec = [m for m in ray_rows if (m.first.k or m.first.tree) and m.first.batch == 1 and m.first.temperature == temp]
        if plain and spec:
            top = max(spec, key=lambda m: m.median)
            target = RAY_TARGETS.get(temp)
            verdicts.append(f"the Ray engine with the draft actor, batch 1, T = {temp}"
                            + (f": ≥ {target}× its own plain decoding — **{'met' if top.median / plain >= target else 'NOT met'}**"
                               if target else " against its own plain decoding")
                            + f" ({top.median / plain:.2f}×, {top.label}: {top.median:.1f} against {plain:.1f} tok/s)")
    same_k = [ks.median / hf.median for ks in ours for hf in [theirs.get((ks.first.temperature, ks.first.k))]
              if hf and ks.first.batch == 1 and ks.first.k and not ks.first.adaptive and not ks.first.tree]
    plain_ratio = [base[(1, t)] / hf.median for (t, k), hf in theirs.items() if k == 0 and (1, t) in base]
    versus = "" if not same_k else (
        f"Against transformers' assisted generation with the same draft at the same K (batch 1), keyserve's "
        f"speculative rows are {min(same_k):.2f}–{max(same_k):.2f}× as fast; without any draft keyserve's "
        f"plain decoding is already {min(plain_ratio):.2f}–{max(plain_ratio):.2f}× transformers' plain "
        f"decoding, so that much of the lead is plain decoding, not speculation." if plain_ratio else "")
    acc = [m.acceptance for m in ours if m.acceptance is not None and not m.first.adaptive]
    return "\n".join([
        f"SmolLM2-135M-Instruct target, draft `{meta.get('draft', 'drafts/SmolLM2-135M-Instruct-draft')}` (2 layers, pruned "
        f"8192-token head, {meta['draft_params_m']:.1f} M parameters read per token against the "
        f"target's {meta['target_params_m']:.1f} M); float32; {meta['num_prompts']} chat prompts × "
        + (f"at most {meta['max_tokens']} generated tokens per prompt, each answer ending at its EOS as a user's "
           "would (tok/s counts the tokens generated); " if meta.get("stop_at_eos") else
           f"{meta['max_tokens']} generated tokens per configuration (EOS ignored); ")
        + (f"an untimed warm-up of every configuration for every contender, then {meta['repeats']} "
           f"interleaved rounds (medians and min–max spread of tok/s over rounds)"
           + (f", each round in {meta['slices']} slices of the prompts (every configuration on one slice, "
              "then the next)" if meta.get("slices", 1) > 1 else "") if "repeats" in meta else
           "an older run: one round (no spread), a warm-up for keyserve alone")
        + (f" (measured by `{meta['command']}`)" if "command" in meta else "")
        + f"; torch threads {meta['threads']} on both "
        f"sides; transformers {meta['transformers']}. Load average before {meta['load_before']}, after "
        f"{meta['load_after']}; wall time {meta['wall_min']:.1f} min.",
        "",
        "Targets (issue 19, this run; best of fixed K and adaptive K over keyserve's own plain decoding): "
        + "; ".join(verdicts) + ".",
        "",
        markdown_table(["batch", "temperature", "keyserve no spec tok/s", "keyserve best fixed K tok/s",
                        "speed-up", "keyserve adaptive K tok/s", "transformers tok/s",
                        "transformers assisted best tok/s", "keyserve best spec / transformers assisted best",
                        "keyserve no spec / transformers no spec"], summary),
        "",
        versus,
        "",
        ("Adaptive K's outcome guard (core/spec_guard.py) turned speculation off, over the whole run "
         "(warm-up and rounds; the adaptive rows only): "
         + "; ".join(f"{k}: {v} time(s)" for k, v in meta["guard_losses"].items()) + ".")
        if meta.get("guard_losses") else "",
        "",
        "All rows (tok/s = generated tokens ÷ wall time of the generate calls, median over rounds; spread = "
        "slowest–fastest round; acceptance = accepted ÷ drafted; tokens per target forward counts the "
        "bonus/recovered token; tokens = per round):",
        "",
        markdown_table(["engine", "batch", "temperature", "K", "tokens", "tok/s", "spread tok/s", "acceptance",
                        "tokens / target forward", "vs the same engine without a draft",
                        "vs transformers assisted, same K", "share drafted by lookup",
                        "acceptance: lookup / model"],
                       table),
        "",
        "The speed-up at K is about (tokens per target forward) ÷ (cost of a speculative step ÷ cost of a plain "
        "one); acceptance here ranges "
        + (f"{min(acc):.2f}–{max(acc):.2f}" if acc else "–")
        + " (see the draft's README), and the step cost is in the next section.",
        "",
        f"![speculative speed-up against K]({meta.get('plot', 'bench_spec.png')})",
    ])


def _fastest(rows: list[Measured], key) -> dict:
    """The fastest contender (by median) for each key of its labels."""
    out: dict = {}
    for m in rows:
        k = key(m.first)
        if k not in out or m.median > out[k].median:
            out[k] = m
    return out


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = [m for m in aggregate(rows).values() if not m.first.adaptive]  # medians over rounds
    base = {(m.first.engine, m.first.batch, m.first.temperature): m.median for m in agg if m.first.plain}
    for m in agg:  # prompt lookup alone runs on keyserve's engine: its plain decoding is the base
        if m.first.engine == "ngram" and ("keyserve", m.first.batch, m.first.temperature) in base:
            base[("ngram", m.first.batch, m.first.temperature)] = base[("keyserve", m.first.batch, m.first.temperature)]
    lookups = sorted({m.first.lookup for m in agg})
    doubts = sorted({m.first.confidence for m in agg})  # one line per confidence threshold too
    from keyserve.core.spec_tree import TreeShape

    fig, ax = plt.subplots(figsize=(7, 4))
    colours = {}
    for key, lookup, doubt in ((key, n, c) for key in sorted(base) for n in lookups for c in doubts):
        pts = sorted((m for m in agg if (m.first.engine, m.first.batch, m.first.temperature) == key and m.first.k
                      and m.first.lookup == lookup and m.first.confidence == doubt), key=lambda m: m.first.k)
        trees = [m for m in agg if (m.first.engine, m.first.batch, m.first.temperature) == key and m.first.tree
                 and not lookup and not doubt]
        if not pts and not trees:
            continue
        (line,) = ax.plot([m.first.k for m in pts], [m.median / base[key] for m in pts],
                          marker="s" if doubt else "o",
                          linestyle=":" if lookup else "-" if key[0] == "keyserve" else "--",
                          label=f"{key[0]} batch {key[1]} T={key[2]}" + (f", conf ≥ {doubt:g}" if doubt else "")
                          + (f" + lookup ≤ {lookup}" if lookup else "") + (" (stars: trees)" if trees else ""))
        colours[key, lookup] = line.get_color()
        for m in trees:  # one star per tree shape, at its node count, labelled with the shape
            x, y = TreeShape.parse(m.first.tree).num_nodes, m.median / base[key]
            ax.scatter([x], [y], marker="*", s=110, zorder=3, color=colours[key, lookup])
            ax.annotate(m.first.tree, (x, y), textcoords="offset points", xytext=(6, -3), fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("K (draft tokens per step; a tree at its node count)")
    ax.set_ylabel("speed-up over the same engine without a draft")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: no point hidden
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")


def _load_avg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--trees", nargs="*", default=[],
                    help="tree shapes to verify as well (speculative_tree, e.g. 2x1 3x2): keyserve in process, "
                         "and with --ray the Ray engine")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--num-prompts", type=int, default=16,
                    help="prompts per configuration, every batch size (rounded up to a multiple of it)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--skip-adaptive", action="store_true", help="no adaptive-K rows")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="answers end at their EOS (as a user's would) instead of running to --max-tokens: "
                         "no text past the answer, which neither the target's chat training nor the draft's "
                         "covers")
    ap.add_argument("--lookups", type=int, nargs="*", default=[],
                    help="also every in-process chain row (fixed and adaptive K) with prompt lookup first, "
                         "n-grams up to each of these (prompt_lookup_max)")
    ap.add_argument("--lookup-min", type=int, default=2, help="prompt lookup's shortest n-gram (prompt_lookup_min)")
    ap.add_argument("--ngram", type=int, nargs="*", default=[],
                    help="also every in-process chain row (fixed and adaptive K) speculating by prompt lookup "
                         "alone, no draft model (draft='ngram'), n-grams up to each of these")
    ap.add_argument("--confidences", type=float, nargs="*", default=[],
                    help="also in-process chains that end where the draft's own distribution peaks below each "
                         "of these (draft_confidence_threshold), at each of --confident-ks, alone and with each "
                         "--lookups")
    ap.add_argument("--confident-ks", type=int, nargs="*", default=[],
                    help="the K (the chain's cap) of the --confidences rows (default: --ks)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--draft", default="default",
                    help="the draft model: the committed one ('default') or a draft directory (e.g. an earlier "
                         "version checked out from git, to measure two drafts one after the other)")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers rows")
    ap.add_argument("--ray", action="store_true",
                    help="also the Ray engine (TP = 1, draft actor) at batch 1 against its own plain decoding")
    ap.add_argument("--section", default="speculative",
                    help="the BENCHMARKS.md section written (a partial run: a section of its own, e.g. speculative_ray)")
    ap.add_argument("--ray-temperatures", type=float, nargs="+", default=sorted(RAY_TARGETS),
                    help="temperatures of the Ray rows (default: those with a target)")
    ap.add_argument("--json", type=Path, default=DOCS / "bench_spec.json")
    ap.add_argument("--render", action="store_true", help="re-render --json without measuring")
    ap.add_argument("--no-write", action="store_true", help="print only: no json, plot or BENCHMARKS.md")
    ap.add_argument("--step-cost", action="store_true",
                    help="the per-step cost model instead (plain vs speculative, by phase; issue 19)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (at least 3 for a spread)")
    ap.add_argument("--slices", type=int, default=4,
                    help="each round runs every configuration on one slice of the prompts' batches, then the "
                         "next (order reversed every other slice), so that a drift of the machine's speed "
                         "within a round lands on every contender alike; 1: each configuration's prompts at once")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another --step-cost json to show beside this run (--step-cost)")
    args = ap.parse_args()
    if args.step_cost:
        return main_step_cost(args)
    if args.render:
        saved = json.loads(args.json.read_text())
        rows, meta = [Row(**r) for r in saved["rows"]], saved["meta"]
    else:
        rows, meta = measure(args)
        meta["command"] = command_line()
        if args.draft != "default":
            meta["draft"] = args.draft
        meta["plot"] = "bench_spec.png" if args.section == "speculative" else f"bench_{args.section}.png"
        if not args.no_write:  # a smoke run leaves the committed results alone
            args.json.write_text(json.dumps({"rows": [asdict(r) for r in rows], "meta": meta}, indent=1))
    body = render(rows, meta)
    print(body)
    if not args.no_write:
        plot(rows, DOCS / meta.get("plot", "bench_spec.png"))
        if args.section == "speculative":
            update_section("speculative", "Speculative sampling: distilled draft vs none vs transformers' assisted "
                           "generation (issue 5)", body)  # title kept: other pages link to its anchor
        else:  # a partial run (e.g. the Ray rows alone) beside the full one, not over it
            update_section(args.section, SECTION_TITLES.get(args.section, f"Speculative sampling: {args.section}"), body)


def main_step_cost(args: argparse.Namespace) -> None:
    path = args.json if args.json != DOCS / "bench_spec.json" else DOCS / "bench_spec_step.json"
    if args.render:
        saved = json.loads(path.read_text())
        rows, meta = [StepCost(**r) for r in saved["rows"]], saved["meta"]
    else:
        rows, meta = step_cost(args)
        if not args.no_write:
            path.write_text(json.dumps({"rows": [asdict(r) for r in rows], "meta": meta}, indent=1))
    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    body = render_step_cost(rows, meta, baseline)
    print(body)
    if not args.no_write:
        update_section("speculative_step_cost", "Speculative step cost: plain vs speculative decode step, by "
                       "phase (issue 19)", body)


RAY_IDLE_RELEASE_S = 0.3  # the Ray engines' graph idle release in this bench (default 2 s)


def ray_engines(args: argparse.Namespace) -> dict:
    """The Ray engine at TP = 1 twice on a local cluster: without a draft (its own plain
    decoding) and with the draft actor. Prefix caching off on both (the rows repeat prompts;
    the in-process engine resets its cache before each row instead)."""
    import os

    import ray

    from keyserve.llm import RayLLM

    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
             object_store_memory=200 * 1024**2)
    opts = dict(tensor_parallel_size=1, enable_prefix_caching=False, max_num_seqs=max(args.batches),
                graph_idle_release_s=RAY_IDLE_RELEASE_S)
    return {"plain": RayLLM(**opts),
            "draft": RayLLM(draft=args.draft, num_speculative_tokens=max(args.ks), **opts)}


def measure(args: argparse.Namespace) -> tuple[list[Row], dict]:
    from transformers import AutoModelForCausalLM
    import transformers

    from keyserve import LLM
    from keyserve.training.hf import draft_for_transformers

    transformers.logging.set_verbosity_error()  # generate() warns about our explicit config
    if args.threads:
        torch.set_num_threads(args.threads)
    start, load_before = time.perf_counter(), _load_avg()
    llm = LLM(draft=args.draft, num_speculative_tokens=max([*args.ks, *args.confident_ks]),
              max_num_seqs=max(args.batches))
    tok = llm.tokenizer
    path = str(llm.engine.loaded.path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    draft = draft_for_transformers(args.draft, hf)
    counters = (ForwardCounter(hf), ForwardCounter(draft))
    draft_params = sum(p.numel() for n, p in draft.named_parameters() if "embed" not in n)
    target_params = sum(p.numel() for p in hf.parameters())

    rays = ray_engines(args) if args.ray else {}
    # (engine, adaptive, batch, temperature, K, tree): K is the cap for adaptive rows.
    configs = [("keyserve", False, b, t, k, "") for t in args.temperatures for b in args.batches for k in [0, *args.ks]]
    configs += [("keyserve", False, b, t, 0, tree) for t in args.temperatures for b in args.batches
                for tree in args.trees]
    if rays:  # batch 1 (the target's), plain on its own engine, fixed and adaptive K on the draft's
        configs += [("ray", False, 1, t, k, "") for t in args.ray_temperatures for k in [0, *args.ks]]
        configs += [("ray", True, 1, t, max(args.ks), "") for t in args.ray_temperatures]
        configs += [("ray", adaptive, 1, t, max(args.ks) if adaptive else 0, tree) for t in args.ray_temperatures
                    for tree in args.trees for adaptive in ([False] if args.skip_adaptive else [False, True])]
    if not args.skip_adaptive:  # chains', and each tree's (the tree or plain decoding, per sequence)
        configs += [("keyserve", True, b, t, max(args.ks), tree) for t in args.temperatures for b in args.batches
                    for tree in ["", *args.trees]]
    if not args.skip_hf:
        configs += [("transformers", False, 1, t, k, "") for t in args.temperatures for k in [0, *args.ks]]
    # Prompt lookup before the draft model (core/prompt_lookup.py): each in-process chain row again
    configs = [(*c, 0) for c in configs]
    configs += [(*c[:6], n) for n in args.lookups for c in list(configs)
                if c[0] == "keyserve" and c[4] and not c[5] and not c[6]]
    # Prompt lookup alone (draft="ngram"): each in-process chain row with the lookup as the drafter
    configs += [("ngram", *c[1:6], n) for n in args.ngram for c in list(configs)
                if c[0] == "keyserve" and c[4] and not c[5] and not c[6]]
    # Chains that end where the draft doubts (draft_confidence_threshold): fixed K at each of
    # --confident-ks, alone and with each lookup
    configs = [(*c, 0.0) for c in configs]
    configs += [("keyserve", False, b, t, k, "", n, conf) for conf in args.confidences for t in args.temperatures
                for b in args.batches for k in (args.confident_ks or args.ks) for n in [0, *args.lookups]]
    # Interleave engines so slow drift of the machine's load hits every contender alike.
    configs.sort(key=lambda c: (c[3], c[4], c[5], c[6], c[7], c[2], c[0], c[1]))

    ignore_eos = not args.stop_at_eos

    def run(config: tuple, num_prompts: int, max_tokens: int, part: tuple[int, int] = (0, 1)) -> Row | None:
        """One configuration over its prompts' batches number part[0], part[0] + part[1], ...
        (all of them by default); None when that part holds none."""
        engine, adaptive, batch, temp, k, tree, lookup, confidence = config
        n = -(-max(num_prompts, batch) // batch) * batch
        mine = [start for j, start in enumerate(range(0, n, batch)) if j % part[1] == part[0]]
        if not mine:
            return None
        prompts = [PROMPTS[i % len(PROMPTS)] for start in mine for i in range(start, start + batch)]
        with torch.inference_mode():
            if engine == "keyserve":
                with adaptive_k(llm, adaptive), tree_shape(llm, tree), prompt_lookup(llm, lookup, args.lookup_min), \
                        draft_confidence(llm, confidence):
                    return keyserve_run(llm, batch, temp, k, prompts, max_tokens, adaptive, tree, lookup,
                                        ignore_eos=ignore_eos, confidence=confidence)
            if engine == "ngram":
                with lookup_alone(llm, lookup, args.lookup_min), adaptive_k(llm, adaptive):
                    return keyserve_run(llm, batch, temp, k, prompts, max_tokens, adaptive, "", lookup, "ngram",
                                        ignore_eos=ignore_eos)
            if engine == "ray":
                ray_llm = rays["draft" if k or tree else "plain"]
                try:
                    with adaptive_k(ray_llm, adaptive), tree_shape(ray_llm, tree):
                        return keyserve_run(ray_llm, batch, temp, k, prompts, max_tokens, adaptive, tree,
                                            ignore_eos=ignore_eos)
                finally:  # its graph's actors busy-wait until the idle release: let them go first
                    time.sleep(RAY_IDLE_RELEASE_S + 0.3)
            return hf_run(hf, draft, counters, tok, temp, k, prompts, max_tokens, ignore_eos=ignore_eos)

    # Warm-up, untimed, for every contender and configuration: first-call costs (allocations,
    # kernel selection, lazily built caches) land here, on transformers' side too.
    for config in tqdm(configs, desc="warm-up", unit="config"):
        run(config, 1, min(16, args.max_tokens))
    rows = []
    slices = max(1, args.slices)
    for rnd in range(args.rounds):
        order = configs if rnd % 2 == 0 else configs[::-1]
        parts: dict[tuple, Row] = {}
        bar = tqdm(total=len(configs) * slices, desc=f"round {rnd + 1}/{args.rounds}", unit="run")
        for part in range(slices):  # every configuration on this slice of the prompts, then the next
            for config in order if part % 2 == 0 else order[::-1]:
                r = run(config, args.num_prompts, args.max_tokens, (part, slices))
                bar.update(1)
                if r is not None:
                    parts[config] = r if config not in parts else parts[config].merged(r)
        bar.close()
        for config in order:
            r = parts[config]
            r.repeat = rnd
            rows.append(r)
            tqdm.write(f"{r.engine:12s}{' adaptive' if r.adaptive else ''} batch {r.batch} T={r.temperature} "
                       f"K={r.k}{' tree ' + r.tree if r.tree else ''}{' lookup ' + str(r.lookup) if r.lookup else ''}"
                       f"{' conf ' + str(r.confidence) if r.confidence else ''}: "
                       f"{r.tok_s:6.1f} tok/s acceptance {r.acceptance if r.acceptance is not None else '-'}")
    for ray_llm in rays.values():
        ray_llm.shutdown()
    guard = llm.engine.speculative.guard  # the adaptive rows' verdicts over the whole run (core/spec_guard.py)
    guard_losses = {f"batch {b}, T {'> 0' if s else '= 0'}": guard.losses(b, s)
                    for b in args.batches for s in sorted({t > 0 for t in args.temperatures})}
    meta = dict(guard_losses=guard_losses, num_prompts=args.num_prompts, max_tokens=args.max_tokens, repeats=args.rounds,
                stop_at_eos=args.stop_at_eos,
                slices=slices,
                threads=torch.get_num_threads(), ray=bool(rays),
                transformers=transformers.__version__, load_before=load_before, load_after=_load_avg(),
                wall_min=(time.perf_counter() - start) / 60, draft_params_m=draft_params / 1e6,
                target_params_m=target_params / 1e6)
    return rows, meta


if __name__ == "__main__":
    main()
