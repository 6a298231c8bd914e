"""KV budgets: quality and speed of Full / Window / StreamingLLM / H2O / Keyformer (issue 4).

Quality (deterministic): each of ``--num-docs`` real documents (sections of the Python language
reference, 1-3k tokens) is summarised greedily under every policy and budget (a fraction of the
prompt). Reported against the full-attention output: ROUGE-1/2/L of the generated text, the
teacher-forced perplexity of the full output under the policy (and its change vs full), and the
KV bytes each sequence holds. Writes docs/kv_quality_rouge2.png (ROUGE-2 vs budget, like the
Keyformer paper's Figure 7).

Speed: decode step time at 2k and 8k context, batch 1 and 16, with a 50 % budget vs full; and
decode throughput with the KV pool sized for 8 full-attention sequences of 8k (twice as many
budgeted sequences fit). ``--throughput-e2e`` also runs the end-to-end version (16 distinct 8k
prompts through ``LLM.generate``; slow on a CPU, prefill dominates).

    python bench/kv_quality.py --part quality --num-docs 30
    python bench/kv_quality.py --part speed
    python bench/kv_quality.py --part quality --num-docs 2 --budgets 0.5 --no-write   # quick check

Results: the ``kv_quality`` section of docs/BENCHMARKS.md and raw numbers in docs/kv_quality.json
(each part replaces only its own entry, so the parts can run at different times).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.kv_docs import build_documents  # noqa: E402
from bench.report import command_line, machine_description, markdown_table, update_section  # noqa: E402
from bench.workloads import documents  # noqa: E402

from keyserve import LLM, SamplingParams  # noqa: E402
from keyserve.core.sequence import FinishReason  # noqa: E402

JSON_PATH = ROOT / "docs" / "kv_quality.json"
PLOT_PATH = ROOT / "docs" / "kv_quality_rouge2.png"
POLICIES = ["window", "streaming_llm", "h2o", "keyformer"]
# The scoring options as named variants (``--policies``; not run by default): TOVA's window (S =
# the newest query's attention) and pooling (one selection per layer), alone and together, and
# ObservedAttention's mean (S over the queries that saw each token).
VARIANTS: dict[str, tuple[str, str, str]] = {
    "keyformer_last": ("keyformer", "last", "kv_head"),
    "keyformer_layer": ("keyformer", "all", "layer"),
    "keyformer_tova": ("keyformer", "last", "layer"),
    "h2o_tova": ("h2o", "last", "layer"),
    # kvpress's ObservedAttention: S over the number of queries that attended each token
    "keyformer_mean": ("keyformer", "mean", "kv_head"),
    "h2o_mean": ("h2o", "mean", "kv_head"),
}
# A press compresses the prompt to budget x n and keeps every generated token, so its cache ends
# at budget x n + the new tokens; keyserve's k covers the generated tokens too. These variants
# run a policy at the press's peak memory: k = round(budget x n) + --max-new-tokens.
PEAK_MEMORY: dict[str, str] = {"keyformer_peak": "keyformer", "h2o_peak": "h2o"}
# The recent window's share of k (``recent_ratio``, 0.3 in every other row) as an ablation: the
# rest of k goes to the tokens the scores pick.
RECENT: dict[str, tuple[str, float]] = {"keyformer_r10": ("keyformer", 0.1), "keyformer_r50": ("keyformer", 0.5),
                                        "h2o_r10": ("h2o", 0.1), "keyformer_peak_r10": ("keyformer_peak", 0.1)}
ALL_POLICIES = POLICIES + list(VARIANTS) + list(PEAK_MEMORY) + list(RECENT)  # what --policies accepts


def base_policy(name: str) -> str:
    """The KV policy a policy or variant runs (``keyformer_peak`` -> ``keyformer``)."""
    if name in RECENT:
        return base_policy(RECENT[name][0])
    return PEAK_MEMORY.get(name) or VARIANTS.get(name, (name,))[0]


BUDGETS = [0.2, 0.3, 0.5, 0.7, 0.9]
INSTRUCTION = "Summarize the following text in a few sentences.\n\n"
NOTE = ""  # --note: how a run was made (rendered with its part)


# ------------------------------------------------------------------------ helpers
def key(policy: str, budget: float | None) -> str:
    return "full" if policy == "full" else f"{policy}@{budget:g}"


def kv_bytes_per_token(llm: LLM) -> int:
    """K and V of one token in every layer and kv-head: layers × kv heads × head_dim × 2 × bytes."""
    k_cache = llm.engine.runner.kv_caches[0][0]  # [num_blocks, B, kv_heads, head_dim]
    return len(llm.engine.runner.kv_caches) * k_cache.shape[2] * k_cache.shape[3] * 2 * k_cache.element_size()


def params_for(policy: str, budget: float | None, recent_ratio: float, prompt_len: int | None = None,
               max_new_tokens: int = 0, **kw: Any) -> SamplingParams:
    """A policy (or variant) at a budget; the peak-memory variants need ``prompt_len`` and the
    run's ``max_new_tokens`` (their k is round(budget x prompt_len) + max_new_tokens tokens)."""
    if policy == "full":
        return SamplingParams(temperature=0.0, kv_policy="full", **kw)
    if policy in PEAK_MEMORY:
        if prompt_len is None or budget is None:
            raise ValueError(f"{policy} needs the prompt length")
        k = max(1, int(round(budget * prompt_len))) + max_new_tokens
        return SamplingParams(temperature=0.0, kv_policy=base_policy(policy), kv_budget=float(k),
                              recent_ratio=recent_ratio, **kw)
    if policy in RECENT:
        base, recent_ratio = RECENT[policy]
        return params_for(base, budget, recent_ratio, prompt_len, max_new_tokens, **kw)
    base, window, pooling = VARIANTS.get(policy, (policy, "all", "kv_head"))
    return SamplingParams(temperature=0.0, kv_policy=base, kv_budget=budget, recent_ratio=recent_ratio,
                          kv_score_window=window, kv_score_pooling=pooling, **kw)


def run_engine(llm: LLM, ids: list[str], desc: str) -> dict[str, Any]:
    """Step the engine until the given requests finish, with a progress bar."""
    eng = llm.engine
    done: dict[str, Any] = {}
    with tqdm(total=len(ids), desc=desc, leave=False) as bar:
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
    return {rid: done[rid] for rid in ids}


def load_json() -> dict[str, Any]:
    return json.loads(JSON_PATH.read_text()) if JSON_PATH.exists() else {}


def save_json(data: dict[str, Any]) -> None:
    JSON_PATH.parent.mkdir(parents=True, exist_ok=True)
    JSON_PATH.write_text(json.dumps(data, indent=1))


def stamp() -> dict[str, Any]:
    return {"command": command_line(), "date": _dt.date.today().isoformat(), "machine": machine_description(),
            "threads": torch.get_num_threads(), "note": NOTE, "load_average": round(os.getloadavg()[0], 2)}


# ------------------------------------------------------------------------ quality
def run_quality(args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    """Compute every missing (configuration, document) result, then summarise over the documents.

    Results are kept per document (``runs[config][doc]``), so ``--resume`` with more documents
    computes only the new ones, and ``--shard i/n`` runs can be combined with ``--merge``.
    """
    from rouge_score import rouge_scorer

    llm0 = LLM(None, dtype="float32", kv_cache_memory_gb=0.05)  # tokenizer + chat template only
    docs = build_documents(llm0.tokenizer, args.num_docs, args.doc_tokens[0], args.doc_tokens[1], args.doc_target)
    prompts = {d.name: llm0.engine.apply_chat_template([{"role": "user", "content": INSTRUCTION + d.text}])
               for d in docs}
    bpt = kv_bytes_per_token(llm0)
    del llm0
    settings = {
        "doc_tokens": args.doc_tokens, "doc_target": args.doc_target, "max_new_tokens": args.max_new_tokens,
        "recent_ratio": args.recent_ratio, "instruction": INSTRUCTION.strip(), "dtype": "float32",
    }
    old = data.get("quality", {})
    reuse = (args.resume or args.merge) and old.get("settings") == settings
    runs: dict[str, dict[str, Any]] = old.get("runs", {}) if reuse else {}
    wall0 = old.get("wall_s", 0.0) if reuse else 0.0
    merged_from = []
    for path in args.merge or []:
        other = json.loads(Path(path).read_text()).get("quality")
        if other is None:
            continue
        merged_from.append(f"`{other['command']}` ({other.get('wall_s', 0) / 60:.0f} min)")
        if other["settings"] != settings:
            raise SystemExit(f"{path}: different settings, cannot merge")
        for name, per_doc in other["runs"].items():
            for doc, r in per_doc.items():
                runs.setdefault(name, {}).setdefault(doc, {}).update(r)
        wall0 += other.get("wall_s", 0.0)
    shard, nshards = (int(x) for x in args.shard.split("/"))
    mine = [d.name for d in docs][shard::nshards]  # documents this process computes
    q: dict[str, Any] = {**stamp(), "settings": settings, "kv_bytes_per_token": bpt, "runs": runs,
                         "merged_from": merged_from,
                         "docs": [{"name": d.name, "doc_tokens": d.num_tokens, "prompt_tokens": len(prompts[d.name])}
                                  for d in docs if d.name in mine or nshards == 1]}
    t_start = time.perf_counter()
    llm: LLM | None = None

    def engine() -> LLM:
        nonlocal llm
        if llm is None:
            slots = sum(len(prompts[d]) + args.max_new_tokens + 16 for d in mine)
            llm = LLM(None, dtype="float32", num_blocks=2 * slots // 16 + 64, max_num_seqs=2 * len(mine) + 2,
                      max_num_batched_tokens=args.max_num_batched_tokens)
        return llm

    def save() -> None:
        q["wall_s"] = wall0 + time.perf_counter() - t_start
        data["quality"] = q
        save_json(data)

    def run(name: str, policy: str, budget: float | None, gen_docs: list[str], tf_docs: list[str]) -> None:
        eng = engine().engine
        torch.manual_seed(0)  # Keyformer's Gumbel noise
        gen = {eng.add_request(prompts[d], params_for(policy, budget, args.recent_ratio, len(prompts[d]),
                                                      args.max_new_tokens, max_tokens=args.max_new_tokens),
                               prompt_token_ids=prompts[d]): d for d in gen_docs}
        # Teacher forcing of the full output, batched with the generation (one pass over the
        # weights per step serves both).
        tf = {eng.add_request(prompts[d], params_for(policy, budget, args.recent_ratio, len(prompts[d]),
                                                     args.max_new_tokens), prompt_token_ids=prompts[d],
                              forced_token_ids=runs["full"][d]["token_ids"]): d for d in tf_docs}
        what = " + ".join(w for w, x in (("generate", gen), ("perplexity", tf)) if x)
        outs = run_engine(engine(), list(gen) + list(tf), f"{name}: {what}")
        per_doc = runs.setdefault(name, {})
        for rid, d in gen.items():
            o = outs[rid]
            per_doc.setdefault(d, {}).update({
                "token_ids": o.token_ids, "text": o.text, "kv_tokens_held": o.stats.kv_tokens_held,
                "kv_tokens_evicted": o.stats.kv_tokens_evicted, "kv_blocks_used": o.stats.kv_blocks_used,
            })
        for rid, d in tf.items():
            o = outs[rid]
            per_doc.setdefault(d, {}).update({"nll": -sum(o.outputs[0].logprobs),
                                              "tf_kv_tokens_held": o.stats.kv_tokens_held})
        save()

    def missing(name: str, field: str) -> list[str]:
        return [d for d in mine if field not in runs.get(name, {}).get(d, {})]

    # Full attention: the reference summaries, then their perplexity under full attention.
    if missing("full", "token_ids"):
        run("full", "full", None, missing("full", "token_ids"), [])
    if not args.no_ppl and missing("full", "nll"):
        run("full", "full", None, [], missing("full", "nll"))
    # The 50 % budget (the targets) first, with its perplexity; then the other budgets'
    # summaries; then their perplexities. Each configuration is saved as it completes.
    first = [b for b in args.budgets if b == 0.5]
    rest = [b for b in args.budgets if b != 0.5]
    ppl = [] if args.no_ppl else args.ppl_budgets
    tasks = [(p, b, True, b in ppl) for b in first for p in args.policies]
    tasks += [(p, b, True, False) for b in rest for p in args.policies]
    tasks += [(p, b, False, True) for b in rest if b in ppl for p in args.policies]
    for policy, budget, want_gen, want_tf in tqdm(tasks, desc="configurations"):
        name = key(policy, budget)
        gen_docs = missing(name, "token_ids") if want_gen else []
        tf_docs = missing(name, "nll") if want_tf else []
        if gen_docs or tf_docs:
            run(name, policy, budget, gen_docs, tf_docs)
    if llm is not None:
        del llm
    # Summaries over the requested documents (all of them, whichever process computed them).
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    names = [d for d in (x.name for x in docs) if d in mine or nshards == 1]
    q["docs"] = [{"name": d.name, "doc_tokens": d.num_tokens, "prompt_tokens": len(prompts[d.name])}
                 for d in docs if d.name in names]
    plist = [prompts[d] for d in names]
    full = collect(runs["full"], names)
    q["configs"] = {"full": summarize_config(full, full, plist, None, bpt, scorer)}
    nominal = POLICIES + list(VARIANTS) + [p for p, (base, _) in RECENT.items() if base not in PEAK_MEMORY]
    for name in [key(p, b) for p in nominal for b in BUDGETS]:  # every complete one
        if all("token_ids" in runs.get(name, {}).get(d, {}) for d in names):
            budget = float(name.split("@")[1])
            q["configs"][name] = summarize_config(collect(runs[name], names), full, plist, budget, bpt, scorer)
    for c in q["configs"].values():  # the texts stay in `runs`
        c.pop("token_ids", None)
        c.pop("texts", None)
    save()
    return q


def collect(per_doc: dict[str, dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Per-document results → lists in document order (perplexity only if every document has it)."""
    rows = [per_doc[d] for d in names]
    out: dict[str, Any] = {
        "token_ids": [r["token_ids"] for r in rows], "texts": [r["text"] for r in rows],
        "kv_tokens_held": [r["kv_tokens_held"] for r in rows],
        "kv_blocks_used": [r["kv_blocks_used"] for r in rows],
    }
    if all("nll" in r for r in rows):
        out["nll"] = [r["nll"] for r in rows]
        if all("tf_kv_tokens_held" in r for r in rows):
            out["tf_kv_tokens_held"] = [r["tf_kv_tokens_held"] for r in rows]
    return out


def summarize_config(
    res: dict[str, Any], full: dict[str, Any], prompts: list[list[int]], budget: float | None, bpt: int, scorer: Any
) -> dict[str, Any]:
    """Add ROUGE vs full, perplexity of the full output, and KV bytes to a configuration's raw results."""
    rouge = [scorer.score(ref, hyp) for ref, hyp in zip(full["texts"], res["texts"])]
    for m in ("rouge1", "rouge2", "rougeL"):
        res[m] = [r[m].fmeasure for r in rouge]
        res[m + "_mean"] = sum(res[m]) / len(res[m])
    counts = [len(t) for t in full["token_ids"]]
    if "nll" in res:
        res["ppl"] = math.exp(sum(res["nll"]) / sum(counts))
        if "ppl" in full:
            res["ppl_change"] = res["ppl"] / full["ppl"] - 1.0
            per_doc = [math.exp((a - b) / n) - 1.0 for a, b, n in zip(res["nll"], full["nll"], counts)]
            res["ppl_change_per_doc_mean"] = sum(per_doc) / len(per_doc)
    if budget is None:  # full attention holds the prompt and every generated token but the last
        held = [len(p) + len(t) - 1 for p, t in zip(prompts, res["token_ids"])]
        expected = held
    else:
        held = res["kv_tokens_held"]
        expected = [max(1, round(budget * len(p))) for p in prompts]
    res["kv_tokens_expected"] = expected
    res["kv_exact"] = held == expected and (budget is None or res.get("tf_kv_tokens_held", expected) == expected)
    res["kv_bytes"] = [h * bpt for h in held]
    res["kv_bytes_mean"] = sum(res["kv_bytes"]) / len(held)
    res["kv_bytes_per_prompt_byte"] = [h / len(p) for h, p in zip(held, prompts)]
    if budget is not None:  # bytes / (budget × prompt bytes): 1 up to rounding of k
        ratio = [h / (budget * len(p)) for h, p in zip(held, prompts)]
        res["bytes_over_budget"] = [min(ratio), max(ratio)]
    res["gen_tokens_mean"] = sum(len(t) for t in res["token_ids"]) / len(prompts)
    return res


# ------------------------------------------------------------------------ speed
def corpus_tokens(llm: LLM) -> list[int]:
    return list(llm.tokenizer.encode("\n\n".join(text for _, text in documents())))


def time_decode(
    llm: LLM, prompt: list[int], policy: str, budget: float | None, batches: list[int], warmup: int, steps: int
) -> dict[int, dict[str, float]]:
    """Prefill ``prompt`` once as a request with n = max(batches) samples, give every sample its
    own copy of the KV (as distinct prompts would have), then time ``steps`` decode steps at
    each batch size, largest first, finishing samples in between."""
    eng = llm.engine
    bm = eng.block_manager
    bm.reset_prefix_cache()
    batches = sorted(set(batches), reverse=True)
    total = len(batches) * (warmup + steps) + 2
    torch.manual_seed(0)
    sp = params_for(policy, budget, 0.3, max_tokens=total, ignore_eos=True, n=batches[0])
    rid = eng.add_request(prompt, sp, prompt_token_ids=prompt)
    req = eng.requests[rid]
    with tqdm(total=len(prompt), desc=f"prefill {len(prompt)} {key(policy, budget)}", leave=False) as bar:
        while not req.seqs[0].output_token_ids:
            eng.step()
            bar.update(req.seqs[0].num_computed_tokens - bar.n)
    assert len(req.seqs) == batches[0], "every sample forks once the prompt is computed"
    for seq in req.seqs:  # un-share the prompt blocks (budgeted samples already own theirs)
        copies = bm.make_writable(seq, list(range(len(seq.block_table))))
        assert copies is not None, "KV pool too small to give every sample its own prompt"
        eng.runner.copy_blocks(copies)
    out: dict[int, dict[str, float]] = {}
    preempt0 = eng.scheduler.num_preemptions
    for b in batches:
        alive = [s for s in req.seqs if not s.is_finished]
        for seq in alive[b:]:
            eng._finish(seq, FinishReason.ABORT)  # drop samples down to batch b
        alive = alive[:b]
        for _ in range(warmup):
            eng.step()
        times = []
        for _ in tqdm(range(steps), desc=f"decode b={b} {key(policy, budget)}", leave=False):
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        times.sort()
        out[b] = {
            "step_s_median": times[len(times) // 2],
            "step_s_min": times[0],
            "step_s_mean": sum(times) / len(times),
            "context": alive[0].num_tokens,
            "kv_blocks_per_seq": len(alive[0].block_table),
        }
    assert eng.scheduler.num_preemptions == preempt0, "a preemption spoiled the timing"
    eng.abort(rid)
    return out


def run_speed(args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    bs = 16
    max_batch = max(args.speed_batches + [16])
    steps_total = (len(args.speed_batches) + 1) * (args.warmup + args.steps) + 2
    max_ctx = max(args.contexts)
    # Every sample of the largest batch holds its own full-attention KV.
    num_blocks = max_batch * -(-max_ctx // bs) + 64
    llm = LLM(None, dtype="float32", num_blocks=num_blocks, max_num_seqs=max(64, max_batch),
              max_num_batched_tokens=args.speed_batched_tokens)
    bpt = kv_bytes_per_token(llm)
    corpus = corpus_tokens(llm)
    limit = llm.engine.max_model_len
    sp: dict[str, Any] = {**stamp(), "kv_bytes_per_token": bpt, "budget": args.speed_budget,
                          "policies": args.speed_policies, "steps": args.steps, "warmup": args.warmup,
                          "decode": {}, "throughput": {}}
    # Throughput: a pool sized for `throughput_seqs` full sequences of `throughput_context` tokens.
    tctx = args.throughput_context
    pool_blocks = args.throughput_seqs * -(-tctx // bs)
    t_start = time.perf_counter()
    for ctx in args.contexts:
        n_prompt = min(ctx, limit) - steps_total - 1
        prompt = corpus[:n_prompt]
        for policy in ["full"] + args.speed_policies:
            budget = None if policy == "full" else args.speed_budget
            batches = list(args.speed_batches)
            if ctx == tctx:  # the batch that fills the throughput pool
                k = n_prompt + steps_total if budget is None else max(1, round(budget * n_prompt))
                batches.append(min(max_batch, pool_blocks // -(-k // bs)))
            res = time_decode(llm, prompt, policy, budget, batches, args.warmup, args.steps)
            sp["decode"][f"{ctx}/{key(policy, budget)}"] = {"prompt_tokens": n_prompt, "by_batch": res}
            if ctx == tctx:
                cap = batches[-1]
                sp["throughput"][key(policy, budget)] = {
                    "pool_blocks": pool_blocks, "seqs_fit": cap, "blocks_per_seq": res[cap]["kv_blocks_per_seq"],
                    "tokens_per_s": cap / res[cap]["step_s_min"],
                }
            sp["wall_s"] = time.perf_counter() - t_start
            data["speed"] = sp
            save_json(data)
    if args.throughput_e2e:
        sp["throughput_e2e"] = run_throughput_e2e(args, corpus, pool_blocks)
    sp["wall_s"] = time.perf_counter() - t_start
    data["speed"] = sp
    save_json(data)
    return sp


def run_throughput_e2e(args: argparse.Namespace, corpus: list[int], pool_blocks: int) -> dict[str, Any]:
    """16 distinct prompts of ~8k tokens through LLM.generate with the small pool, full vs budget."""
    n_prompt = args.throughput_context - args.e2e_output_tokens - 1
    stride = max(1, (len(corpus) - n_prompt) // max(1, args.e2e_requests - 1))
    prompts = [corpus[i * stride : i * stride + n_prompt] for i in range(args.e2e_requests)]
    out: dict[str, Any] = {"requests": args.e2e_requests, "prompt_tokens": n_prompt,
                           "output_tokens": args.e2e_output_tokens, "pool_blocks": pool_blocks}
    for policy in ["full"] + args.speed_policies:
        budget = None if policy == "full" else args.speed_budget
        llm = LLM(None, dtype="float32", num_blocks=pool_blocks, max_num_seqs=64,
                  max_num_batched_tokens=args.speed_batched_tokens, enable_prefix_caching=False)
        torch.manual_seed(0)
        t = time.perf_counter()
        outs = llm.generate(prompts, params_for(policy, budget, 0.3, max_tokens=args.e2e_output_tokens,
                                                 ignore_eos=True), use_tqdm=True)
        dt = time.perf_counter() - t
        gen = sum(len(o.token_ids) for o in outs)
        out[key(policy, budget)] = {"seconds": dt, "generated": gen, "tokens_per_s": gen / dt,
                                    "preemptions": llm.engine.scheduler.num_preemptions}
        del llm
    return out


# ------------------------------------------------------------------------ report
def plot_rouge2(q: dict[str, Any], path: Path = PLOT_PATH) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = q["configs"]
    fig, ax = plt.subplots(figsize=(6, 4))
    budgets = sorted({float(k.split("@")[1]) for k in cfg if "@" in k})
    ax.plot([b * 100 for b in budgets], [1.0] * len(budgets), "k--", label="full")
    for policy, marker in zip(POLICIES, "osd^"):
        pts = [(b * 100, cfg[key(policy, b)]["rouge2_mean"]) for b in budgets if key(policy, b) in cfg]
        if pts:
            ax.plot(*zip(*pts), marker=marker, label=policy)
    ax.set_xlabel("KV budget (% of prompt)")
    ax.set_ylabel("ROUGE-2 vs full-attention output")
    ax.set_title(f"SmolLM2-135M-Instruct, {len(q['docs'])} documents, greedy summaries")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def quality_tables(q: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    cfg = q["configs"]
    full = cfg["full"]
    budgets = sorted({float(k.split("@")[1]) for k in cfg if "@" in k})
    policies = [p for p in POLICIES if any(key(p, b) in cfg for b in budgets)]
    rows = []
    for name in ["full"] + [key(p, b) for p in policies for b in budgets]:
        if name not in cfg:
            continue
        r = cfg[name]
        pol, _, b = name.partition("@")
        ppl = r.get("ppl")
        rows.append([
            pol, f"{float(b) * 100:g} %" if b else "100 %", r["rouge1_mean"], r["rouge2_mean"], r["rougeL_mean"],
            f"{ppl:.4f}" if ppl else "–",
            f"{r['ppl_change'] * 100:+.2f} %" if "ppl_change" in r else "–",
            f"{sum(r['kv_tokens_expected']) / len(r['kv_tokens_expected']):.0f}",
            f"{r['kv_bytes_mean'] / 2**20:.1f}",
            "yes" if r["kv_exact"] else "NO",
            r["gen_tokens_mean"],
        ])
    main = markdown_table(
        ["policy", "budget", "ROUGE-1", "ROUGE-2", "ROUGE-L", "PPL of full output", "PPL vs full",
         "KV tokens/seq", "KV MiB/seq", "held == round(budget·n)", "gen tokens"], rows)
    r2_rows = [[p] + [f"{cfg[key(p, b)]['rouge2_mean']:.3f}" if key(p, b) in cfg else "–" for b in budgets]
               for p in policies]
    r2 = markdown_table(["ROUGE-2"] + [f"{b * 100:g} %" for b in budgets], r2_rows)
    pairs = [("keyformer", "h2o"), ("h2o", "window")]
    diff_rows = [[f"{a} − {b}"] + [paired_difference(cfg, a, b, x) for x in budgets] for a, b in pairs]
    r2 += ("\n\nPaired per-document difference in ROUGE-2 (mean ± 95 % confidence half-width, 1.96 × the "
           "standard error over the documents): an interval that contains 0 means the documents do not tell "
           "the two policies apart at that budget.\n\n"
           + markdown_table(["ROUGE-2 difference"] + [f"{b * 100:g} %" for b in budgets], diff_rows))
    # Targets
    checks: dict[str, Any] = {}
    order_fail = []
    compared = 0
    for b in budgets:
        try:
            kf, h2o, win = (cfg[key(p, b)]["rouge2_mean"] for p in ("keyformer", "h2o", "window"))
        except KeyError:
            continue
        compared += 1
        if not (kf >= h2o >= win):
            order_fail.append(f"{b * 100:g} % (keyformer {kf:.3f}, h2o {h2o:.3f}, window {win:.3f}; paired "
                              f"keyformer − h2o {paired_difference(cfg, 'keyformer', 'h2o', b)})")
    if compared:
        detail = "missed at " + "; ".join(order_fail) if order_fail else f"at every budget measured ({compared})"
        checks["order"] = (not order_fail, detail)
    kf50 = cfg.get(key("keyformer", 0.5), {})
    if "ppl_change" in kf50:
        checks["ppl"] = (kf50["ppl_change"] <= 0.01, f"{kf50['ppl_change'] * 100:+.2f} %")
    budgeted = [r for n, r in cfg.items() if "@" in n]
    exact = all(r["kv_exact"] for r in budgeted)
    lo = min(r["bytes_over_budget"][0] for r in budgeted) if budgeted else 1
    hi = max(r["bytes_over_budget"][1] for r in budgeted) if budgeted else 1
    checks["bytes"] = (exact, f"held = round(budget × prompt) in every run; bytes/(budget × prompt bytes) "
                              f"∈ [{lo:.4f}, {hi:.4f}] (rounding of k only); {q['kv_bytes_per_token']} B/token")
    return f"{main}\n\nROUGE-2 against the full-attention output, by budget:\n\n{r2}", checks


def paired_difference(cfg: dict[str, Any], a: str, b: str, budget: float) -> str:
    """Mean ± 1.96 standard errors of policy a's per-document ROUGE-2 minus policy b's."""
    ra, rb = cfg.get(key(a, budget), {}).get("rouge2"), cfg.get(key(b, budget), {}).get("rouge2")
    if not ra or not rb or len(ra) != len(rb) or len(ra) < 2:
        return "–"
    d = [x - y for x, y in zip(ra, rb)]
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
    return f"{mean:+.3f} ± {1.96 * sd / math.sqrt(len(d)):.3f}"


def speed_tables(sp: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    rows = []
    checks: dict[str, Any] = {}
    dec = sp["decode"]
    for name, r in dec.items():
        ctx, _, pol = name.partition("/")
        base = dec.get(f"{ctx}/full")
        for b, t in sorted(r["by_batch"].items(), key=lambda kv: int(kv[0])):
            ratio = t["step_s_min"] / base["by_batch"][b]["step_s_min"] if base and b in base["by_batch"] else None
            rows.append([ctx, pol, b, f"{t['step_s_median'] * 1000:.0f}", f"{t['step_s_min'] * 1000:.0f}",
                         f"{t['step_s_min'] * 1000 / int(b):.1f}",
                         f"{ratio:.2f}" if ratio is not None and pol != "full" else "–", t["kv_blocks_per_seq"]])
    decode = markdown_table(["context", "policy", "batch", "step ms (median)", "step ms (min)", "ms/token (min)",
                             "step vs full (min)",
                             "KV blocks/seq"], rows)
    kf8 = dec.get(f"{max(int(n.split('/')[0]) for n in dec)}/{key('keyformer', sp['budget'])}")
    full8 = dec.get(f"{max(int(n.split('/')[0]) for n in dec)}/full")
    if kf8 and full8 and "16" in kf8["by_batch"] and "16" in full8["by_batch"]:
        ratio = kf8["by_batch"]["16"]["step_s_min"] / full8["by_batch"]["16"]["step_s_min"]
        checks["step"] = (ratio <= 0.6, f"{ratio:.2f}× full")
    thr = sp["throughput"]
    trows = []
    f = thr.get("full")
    for name, r in thr.items():
        gain = r["tokens_per_s"] / f["tokens_per_s"] if f else None
        trows.append([name, r["pool_blocks"], r["blocks_per_seq"], r["seqs_fit"], f"{r['tokens_per_s']:.1f}",
                      f"{gain:.2f}×" if gain and name != "full" else "–"])
    tp = markdown_table(["policy", "pool blocks", "blocks/seq", "sequences that fit", "decode tokens/s", "vs full"],
                        trows)
    kf = thr.get(key("keyformer", sp["budget"]))
    if kf and f:
        gain = kf["tokens_per_s"] / f["tokens_per_s"]
        checks["throughput"] = (gain >= 1.8, f"{gain:.2f}× full")
    body = f"Decode step time (batch × one token), after a prompt of the given context:\n\n{decode}\n\n" \
           f"Decode throughput with the KV pool sized for the full-attention sequences below " \
           f"(as many sequences as fit, each at the context above):\n\n{tp}"
    e2e = sp.get("throughput_e2e")
    if e2e:
        erows = [[n, f"{r['seconds']:.0f}", r["generated"], f"{r['tokens_per_s']:.2f}", r["preemptions"]]
                 for n, r in e2e.items() if isinstance(r, dict)]
        body += (f"\n\nEnd to end ({e2e['requests']} distinct prompts of {e2e['prompt_tokens']} tokens × "
                 f"{e2e['output_tokens']} output tokens, prefill included):\n\n"
                 + markdown_table(["policy", "seconds", "generated", "tokens/s", "preemptions"], erows))
    return body, checks


def render(data: dict[str, Any]) -> str:
    parts = []
    checks: dict[str, Any] = {}
    q = data.get("quality")
    if q:
        s = q["settings"]
        docs = q["docs"]
        n = [d["prompt_tokens"] for d in docs]
        body, c = quality_tables(q)
        checks.update(c)
        parts.append(
            f"### Quality\n\nCommand: `{q['command']}` ({q['date']}, {q.get('threads', '?')} torch thread(s), "
            f"{q.get('wall_s', 0) / 60:.0f} min of wall time summed over the runs)  \n"
            + (f"Merging the per-document results of: {'; '.join(q['merged_from'])}.  \n" if q.get("merged_from") else "")
            + (f"{q['note']}  \n" if q.get("note") else "") +
            f"{len(docs)} documents (sections of the Python language reference, `pydoc_data.topics`, "
            f"cut/merged to {s['doc_tokens'][0]}–{s['doc_tokens'][1]} tokens), prompt = chat template with "
            f"\"{s['instruction']}\" + document: {min(n)}–{max(n)} tokens (mean {sum(n) / len(n):.0f}). "
            f"Greedy, ≤ {s['max_new_tokens']} new tokens (EOS ends a summary), float32, recent_ratio "
            f"{s['recent_ratio']}, `torch.manual_seed(0)` before each configuration. ROUGE (F1, `rouge_score`, "
            f"stemmed) of each policy's summary against the full-attention summary; perplexity = exp(mean NLL) "
            f"of the full-attention summary teacher-forced under the policy. KV per sequence = tokens held per "
            f"(layer, kv-head) × {q['kv_bytes_per_token']} B (30 layers × 3 kv heads × 64 × 2 × 4 B); for full "
            f"it is prompt + generated − 1 tokens.\n\n{body}\n\n![ROUGE-2 vs budget](kv_quality_rouge2.png)"
        )
    sp = data.get("speed")
    if sp:
        body, c = speed_tables(sp)
        checks.update(c)
        parts.append(
            f"### Speed\n\nCommand: `{sp['command']}` ({sp['date']}, {sp.get('threads', '?')} torch thread(s), "
            f"wall time {sp.get('wall_s', 0) / 60:.0f} min)  \n"
            + (f"{sp['note']}  \n" if sp.get("note") else "") +
            f"Machine: {sp['machine']}.  \n"
            + (f"Load average (1 min) when it started: {sp['load_average']}.  \n" if "load_average" in sp else "") +
            f"Method: one prompt per "
            f"(context, policy) is prefilled as a request with n samples; every sample then gets its own copy "
            f"of the KV (as distinct prompts would), and {sp['steps']} decode steps are timed (after "
            f"{sp['warmup']} warm-up steps) at each batch size; ratios and throughput use the fastest step "
            f"(the least disturbed by other processes). Budget = {sp['budget'] * 100:g} % of the prompt "
            f"({', '.join(sp['policies'])}).\n\n{body}"
        )
    names = {
        "order": "Keyformer ≥ H2O ≥ window in ROUGE-2 at every budget",
        "ppl": "Keyformer at 50 %: perplexity of the full output + ≤ 1 %",
        "bytes": "KV bytes exactly proportional to the budget",
        "step": "8k context, batch 16: decode step with a 50 % budget ≤ 0.6× full",
        "throughput": "Pool for 8 full 8k sequences: throughput with a 50 % budget ≥ 1.8× full",
    }
    trows = [[names[k], "met" if ok else "**MISSED**", detail] for k, (ok, detail) in checks.items()]
    targets = "### Targets (issue 4)\n\n" + markdown_table(["target", "status", "measured"], trows)
    return "\n\n".join([targets] + parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["quality", "speed", "all"], default="all")
    ap.add_argument("--num-docs", type=int, default=30)
    ap.add_argument("--doc-tokens", type=int, nargs=2, default=[1000, 3000], metavar=("MIN", "MAX"))
    ap.add_argument("--doc-target", type=int, default=1000, help="cut long sections at about this many tokens")
    ap.add_argument("--budgets", type=float, nargs="+", default=BUDGETS)
    ap.add_argument("--ppl-budgets", type=float, nargs="*", default=None,
                    help="budgets at which to teacher-force the perplexity (default: all)")
    ap.add_argument("--no-ppl", action="store_true", help="skip the teacher-forced perplexity")
    ap.add_argument("--policies", nargs="+", default=POLICIES, choices=ALL_POLICIES)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--recent-ratio", type=float, default=0.3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--resume", action="store_true", help="reuse the per-document results already in the JSON")
    ap.add_argument("--shard", default="0/1", help="i/n: compute only every n-th document, starting at i")
    ap.add_argument("--merge", nargs="*", default=None, metavar="JSON",
                    help="add the per-document results of other runs (e.g. shards) before computing")
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "kv_quality.json", help="raw results (default docs/kv_quality.json)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--speed-batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--speed-policies", nargs="+", default=["keyformer", "window"], choices=POLICIES)
    ap.add_argument("--speed-budget", type=float, default=0.5)
    ap.add_argument("--speed-batched-tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per batch size")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--throughput-seqs", type=int, default=8)
    ap.add_argument("--throughput-context", type=int, default=8192)
    ap.add_argument("--throughput-e2e", action="store_true", help="also run the end-to-end throughput workload")
    ap.add_argument("--e2e-requests", type=int, default=16)
    ap.add_argument("--e2e-output-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/ untouched")
    ap.add_argument("--note", default="", help="a remark on how this run was made, shown with its results")
    args = ap.parse_args()
    if args.ppl_budgets is None:
        args.ppl_budgets = args.budgets
    torch.set_num_threads(args.threads)
    global NOTE
    NOTE = args.note
    if "--note" in sys.argv:  # the note is shown on its own, not inside the recorded command
        i = sys.argv.index("--note")
        del sys.argv[i : i + 2]
    global JSON_PATH
    JSON_PATH = args.json
    if args.no_write and args.json == ROOT / "docs" / "kv_quality.json":
        JSON_PATH = Path("/tmp/kv_quality.json")
    data = load_json()
    for path in args.merge or []:  # speed results measured by another run
        other = json.loads(Path(path).read_text())
        if "speed" in other and args.part == "quality":
            data["speed"] = other["speed"]
    if args.part in ("quality", "all"):
        run_quality(args, data)
        if not args.no_write:
            plot_rouge2(data["quality"])
    if args.part in ("speed", "all"):
        run_speed(args, data)
    data = json.loads(json.dumps(data))  # the same (string) keys as a reloaded file
    text = render(data)
    print(text)
    if not args.no_write:
        update_section("kv_quality", "KV budgets: quality and speed (issue 4)", text)


if __name__ == "__main__":
    main()
