"""KV budgets against the field (issue 21): keyserve's policies beside NVIDIA's kvpress presses.

The same documents, prompts, model (SmolLM2-135M-Instruct, float32, the local copy keyserve
loads) and greedy settings as ``bench/kv_quality.py``, scored the same way: ROUGE-1/2/L of each
summary against keyserve's full-attention summary, and the perplexity of that full summary
teacher-forced under the compression. keyserve's numbers are read from ``docs/kv_quality.json``
(run that bench first); the presses run in a bench-only venv with kvpress (it pins
transformers < 5.3; ``bench/peers/kvpress_env.py`` builds and caches it) through
``bench/peers/kvpress_worker.py``: StreamingLLM, ObservedAttention (H2O's prompt scores,
averaged over the queries that saw a token), SnapKV, TOVA, ExpectedAttention and Knorm.

One difference is kvpress's, by design: a press compresses the prompt once and then keeps every
generated token (≤ 64 here, ≈ 5 % of a prompt), while a keyserve budget holds k tokens through
decoding too. A ``none`` run (transformers, no press) checks that the two stacks produce the same
full-attention summaries from the same prompts.

    python bench/kvpress_anchor.py --quick          # 3 documents, budgets 30/50/70 %: ~10 min
    python bench/kvpress_anchor.py                  # all documents of kv_quality.json, 5 budgets

Writes the ``kvpress_anchor`` section of docs/BENCHMARKS.md, docs/kvpress_anchor.png and the raw
results in docs/kvpress_anchor.json (per document: ``--resume`` computes only what is missing).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.kv_quality import ALL_POLICIES, BUDGETS, INSTRUCTION, base_policy  # noqa: E402
from bench.peers import kvpress_env  # noqa: E402
from bench.report import command_line, machine_description, markdown_table, update_section  # noqa: E402

PREFIX = "kvpress/"  # press names in the results (keyserve has a streaming_llm of its own)
PRESSES = ["streaming_llm", "observed_attention", "snapkv", "tova", "expected_attention", "knorm"]
# Ablations (``--presses``): keyserve's prompt-phase rule as a press, over all prompt queries or
# the last one only (bench/peers/kvpress_worker.py ``_ablation_press``).
ABLATIONS = ["h2o_prompt", "last_query", "h2o_shared", "last_query_shared"]
WORKER = ROOT / "bench" / "peers" / "kvpress_worker.py"
JSON_PATH = ROOT / "docs" / "kvpress_anchor.json"
PLOT_PATH = ROOT / "docs" / "kvpress_anchor.png"
KS_JSON = ROOT / "docs" / "kv_quality.json"


def key(method: str, budget: float) -> str:
    return f"{method}@{budget:g}"


def label(method: str) -> str:
    """``keyserve h2o`` / ``kvpress tova``."""
    name = method[len(PREFIX):]
    if name in ABLATIONS:
        return f"ablation {name}"
    return f"kvpress {name}" if method.startswith(PREFIX) else f"keyserve {method}"


# ------------------------------------------------------------------ inputs
def prompts_of(doc_names: list[str], num_docs_built: int, settings: dict[str, Any]) -> tuple[dict, Any]:
    """The chat-templated prompt ids of the named documents, built exactly as kv_quality does."""
    from bench.kv_docs import build_documents
    from keyserve import LLM

    llm = LLM(None, dtype="float32", kv_cache_memory_gb=0.05)  # tokenizer + chat template only
    lo, hi = settings["doc_tokens"]
    docs = {d.name: d for d in build_documents(llm.tokenizer, num_docs_built, lo, hi, settings["doc_target"])}
    prompts = {n: llm.engine.apply_chat_template([{"role": "user", "content": INSTRUCTION + docs[n].text}])
               for n in doc_names}
    return prompts, llm.tokenizer


def model_dir() -> str:
    from keyserve.model.loader import resolve_model_dir

    return str(resolve_model_dir(None, progress=False))


def run_presses(tasks: list[dict], args: argparse.Namespace, results_path: Path, eos: int) -> None:
    """Run the missing tasks in the kvpress venv (built on first use), appending to the jsonl."""
    if not tasks:
        return
    python = kvpress_env.ensure_venv()
    job = {"model_dir": model_dir(), "threads": args.threads, "max_new_tokens": args.max_new_tokens,
           "eos_token_id": eos, "tasks": tasks}
    job_path = results_path.with_suffix(".job.json")
    job_path.write_text(json.dumps(job))
    env = dict(kvpress_env.clean_env(), OMP_NUM_THREADS=str(args.threads))
    print(f"kvpress: {len(tasks)} tasks in {python}", file=sys.stderr, flush=True)
    rc = subprocess.run(["nice", "-n", "19", str(python), str(WORKER), str(job_path), str(results_path)],
                        env=env).returncode
    job_path.unlink(missing_ok=True)
    if rc:
        raise SystemExit(f"kvpress worker failed (exit {rc})")


# ------------------------------------------------------------------ scoring
def score_config(texts: list[str], nll: list[float] | None, full: dict[str, Any], scorer: Any) -> dict[str, Any]:
    """ROUGE vs the full summaries; perplexity of the full summaries (and per-document change)."""
    r = [scorer.score(ref, hyp) for ref, hyp in zip(full["texts"], texts)]
    out: dict[str, Any] = {}
    for m in ("rouge1", "rouge2", "rougeL"):
        out[m] = [x[m].fmeasure for x in r]
        out[m + "_mean"] = sum(out[m]) / len(out[m])
    if nll is not None:
        counts = full["counts"]
        out["nll"] = nll
        out["ppl"] = math.exp(sum(nll) / sum(counts))
        out["ppl_change"] = out["ppl"] / full["ppl"] - 1.0
        out["log_ppl_change"] = [(a - b) / n for a, b, n in zip(nll, full["nll"], counts)]
    return out


def paired(a: list[float], b: list[float]) -> tuple[float, float] | None:
    """Mean and 95 % half-width (1.96 standard errors) of the per-document differences a − b."""
    if len(a) != len(b) or len(a) < 2:
        return None
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
    return mean, 1.96 * sd / math.sqrt(len(d))


def fmt_pair(p: tuple[float, float] | None, pct: bool = False) -> str:
    if p is None:
        return "–"
    m, h = p
    return f"{m * 100:+.1f} ± {h * 100:.1f} %" if pct else f"{m:+.3f} ± {h:.3f}"


# ------------------------------------------------------------------ report
def render(rep: dict[str, Any]) -> str:
    cfg, budgets = rep["configs"], rep["budgets"]
    methods = [m for m in rep["keyserve"] + rep["presses"] if any(key(m, b) in cfg for b in budgets)]
    rows = []
    for b in budgets:
        for m in methods:
            c = cfg.get(key(m, b))
            if c is None:
                continue
            rows.append([f"{b * 100:g} %", label(m),
                         f"{c['rouge1_mean']:.3f}", f"{c['rouge2_mean']:.3f}", f"{c['rougeL_mean']:.3f}",
                         f"{c['ppl']:.4f}" if "ppl" in c else "–",
                         f"{c['ppl_change'] * 100:+.2f} %" if "ppl_change" in c else "–"])
    main = markdown_table(["budget", "method", "ROUGE-1", "ROUGE-2", "ROUGE-L", "PPL of full output",
                           "PPL vs full"], rows)
    r2 = markdown_table(["ROUGE-2"] + [f"{b * 100:g} %" for b in budgets],
                        [[label(m)] + [f"{cfg[key(m, b)]['rouge2_mean']:.3f}" if key(m, b) in cfg else "–"
                                for b in budgets] for m in methods])
    pp = markdown_table(["PPL vs full"] + [f"{b * 100:g} %" for b in budgets],
                        [[label(m)] + [f"{cfg[key(m, b)]['ppl_change'] * 100:+.1f} %"
                                if "ppl_change" in cfg.get(key(m, b), {}) else "–" for b in budgets]
                         for m in methods])
    diffs, ldiffs = [], []
    for m in methods:
        if m == "keyformer":
            continue
        diffs.append([f"keyformer − {label(m)}"] + [fmt_pair(paired(cfg[key('keyformer', b)]["rouge2"], cfg[key(m, b)]["rouge2"]))
                                              if key(m, b) in cfg and key("keyformer", b) in cfg else "–"
                                              for b in budgets])
        ldiffs.append([f"keyformer − {label(m)}"] + [
            fmt_pair(paired(cfg[key('keyformer', b)]["log_ppl_change"], cfg[key(m, b)]["log_ppl_change"]), pct=True)
            if "log_ppl_change" in cfg.get(key(m, b), {}) and "log_ppl_change" in cfg.get(key("keyformer", b), {})
            else "–" for b in budgets])
    d_r2 = markdown_table(["ROUGE-2 difference"] + [f"{b * 100:g} %" for b in budgets], diffs)
    d_lp = markdown_table(["log-PPL difference"] + [f"{b * 100:g} %" for b in budgets], ldiffs)
    # Target: Keyformer at least as good as the best press at every budget >= 30 %.
    checks = []
    keyformers = [m for m in rep["keyserve"] if base_policy(m) == "keyformer"]
    for b, kf_name in [(x, m) for x in budgets if x >= 0.3 for m in keyformers]:
        kf = cfg.get(key(kf_name, b))
        pr = [(m, cfg[key(m, b)]) for m in rep["presses"]
              if key(m, b) in cfg and m[len(PREFIX):] not in ABLATIONS]  # the field's presses only
        if not kf or not pr:
            continue
        best_r2 = max(pr, key=lambda x: x[1]["rouge2_mean"])
        ok_r2 = kf["rouge2_mean"] >= best_r2[1]["rouge2_mean"]
        line = (f"{b * 100:g} %: ROUGE-2 {kf_name} {kf['rouge2_mean']:.3f} vs best press {label(best_r2[0])} "
                f"{best_r2[1]['rouge2_mean']:.3f} ({'met' if ok_r2 else 'MISSED'})")
        if "ppl_change" in kf and all("ppl_change" in c for _, c in pr):
            best_pp = min(pr, key=lambda x: x[1]["ppl_change"])
            ok_pp = kf["ppl_change"] <= best_pp[1]["ppl_change"]
            line += (f"; PPL {kf_name} {kf['ppl_change'] * 100:+.1f} % vs best press {label(best_pp[0])} "
                     f"{best_pp[1]['ppl_change'] * 100:+.1f} % ({'met' if ok_pp else 'MISSED'})")
        checks.append(line)
    none = rep.get("none_check")
    docs = rep["docs"]
    n = [d["prompt_tokens"] for d in docs]
    head = (f"Load average (1 min) at the start {rep['load_average']}, {rep['threads']} torch thread(s) for the presses, "
            f"{rep['wall_s'] / 60:.0f} min of wall time for the presses run here  \n"
            + (f"{rep['note']}  \n" if rep.get("note") else "")
            + f"kvpress {rep['kvpress_version']} (transformers {rep['transformers_version']}) in its own venv; "
              f"keyserve's rows are `docs/kv_quality.json` ({rep['keyserve_command']}, {rep['keyserve_date']}).  \n"
              f"{len(docs)} documents ({', '.join(d['name'] for d in docs[:4])}{', …' if len(docs) > 4 else ''}), "
              f"prompts {min(n)}–{max(n)} tokens; greedy, ≤ {rep['max_new_tokens']} new tokens, float32. "
              f"ROUGE against keyserve's full-attention summary; PPL = exp(mean NLL) of that summary "
              f"teacher-forced under the method. A budget is the share of the prompt kept: keyserve holds k = "
              f"budget × n tokens per (layer, kv-head) through decoding, a press compresses the prompt to "
              f"int(budget × n) and keeps the generated tokens.")
    if any(m[len(PREFIX):] in ABLATIONS for m in rep["presses"]):
        head += ("  \nAblations (ours, run as presses, so they select in the prompt phase only and keep the "
                 "generated tokens): `h2o_prompt` is keyserve's H2O prompt-phase rule (attention of every prompt "
                 "query summed over the kv-head's query heads, the round(0.3 k) most recent tokens kept, the top "
                 "of the rest); `last_query` the same from the last prompt query only (TOVA's window, per "
                 "kv-head); `*_shared` the same with one selection per layer from the score averaged over "
                 "all its query heads (TOVA's pooling). h2o_prompt beside keyserve h2o shows what the "
                 "decode-phase evictions cost; last_query beside h2o_prompt what the prompt-phase scoring "
                 "window does; *_shared beside their per-kv-head twins what per-layer pooling does.")
    if none:
        head += (f"  \nSame-stack check: transformers without a press reproduces keyserve's full summaries "
                 f"token for token in {none['same']}/{none['docs']} documents (ROUGE-2 {none['rouge2']:.3f}), "
                 f"PPL {none['ppl']:.4f} vs keyserve {none['ks_ppl']:.4f}.")
    return (f"{head}\n\n### Target: Keyformer ≥ the best press at every budget ≥ 30 %\n\n"
            + "\n".join(f"- {c}" for c in checks)
            + f"\n\n### All methods\n\n{main}\n\nROUGE-2 by budget:\n\n{r2}\n\nPerplexity change by budget:\n\n{pp}\n\n"
              f"Paired per-document differences (mean ± 95 % half-width, 1.96 standard errors over the "
              f"documents; an interval containing 0 does not tell the two apart). ROUGE-2, positive = "
              f"Keyformer better:\n\n{d_r2}\n\nLog-perplexity of the full output per token, negative = "
              f"Keyformer better:\n\n{d_lp}\n\n![keyserve vs kvpress](kvpress_anchor.png)")


def plot(rep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, budgets = rep["configs"], rep["budgets"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for m in rep["keyserve"] + rep["presses"]:
        pts = [(b * 100, cfg[key(m, b)]) for b in budgets if key(m, b) in cfg]
        if not pts:
            continue
        style = dict(marker="o", lw=2) if m in rep["keyserve"] else dict(marker="x", ls="--", lw=1)
        label_ = label(m)
        a1.plot([x for x, _ in pts], [c["rouge2_mean"] for _, c in pts], label=label_, **style)
        if all("ppl_change" in c for _, c in pts):
            a2.plot([x for x, _ in pts], [c["ppl_change"] * 100 for _, c in pts], label=label_, **style)
    a1.set_ylabel("ROUGE-2 vs full-attention output")
    a2.set_ylabel("perplexity of the full output, % over full")
    a2.set_yscale("symlog", linthresh=10)
    for a in (a1, a2):
        a.set_xlabel("KV budget (% of prompt)")
        a.grid(alpha=0.3)
    a1.legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M-Instruct, {len(rep['docs'])} documents: keyserve policies vs kvpress presses")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 documents, budgets 30/50/70 %%")
    ap.add_argument("--num-docs", type=int, default=None, help="the first N documents of kv_quality.json")
    ap.add_argument("--budgets", type=float, nargs="+", default=None)
    ap.add_argument("--presses", nargs="+", default=PRESSES, choices=PRESSES + ABLATIONS)
    ap.add_argument("--no-ppl", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--resume", action="store_true", help="keep the per-document results already in the JSON")
    ap.add_argument("--render-only", action="store_true",
                    help="run nothing: report the configurations already complete in the results (with --resume)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/ untouched")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    budgets = args.budgets or ([0.3, 0.5, 0.7] if args.quick else BUDGETS)
    ks = json.loads(KS_JSON.read_text())["quality"]
    settings = ks["settings"]
    args.max_new_tokens = settings["max_new_tokens"]
    names = [d["name"] for d in ks["docs"]][: (args.num_docs or (3 if args.quick else len(ks["docs"])))]
    note = args.note
    if "--note" in sys.argv:
        i = sys.argv.index("--note")
        del sys.argv[i : i + 2]
    load = round(os.getloadavg()[0], 2)
    prompts, tok = prompts_of(names, len(ks["docs"]), settings)
    want = {d["name"]: d["prompt_tokens"] for d in ks["docs"]}
    bad = [n for n in names if len(prompts[n]) != want[n]]
    if bad:
        raise SystemExit(f"prompts differ from kv_quality.json's for {bad}: rebuild that bench's results first")
    eos = int(tok.eos_token_id) if getattr(tok, "eos_token_id", None) is not None else 2
    scratch = args.no_write and not args.render_only  # a print-only run keeps its results out of docs/
    results_path = (Path("/tmp") if scratch else JSON_PATH.parent) / "kvpress_anchor.jsonl"
    if not args.resume and not args.render_only and results_path.exists():
        results_path.unlink()
    done = {}
    if results_path.exists():
        for line in results_path.read_text().splitlines():
            r = json.loads(line)
            done[(r["press"], float(r["budget"]), r["doc"])] = r
    full_runs = ks["runs"]["full"]
    tasks = []
    for m, b in [("none", 1.0)] + [(p, b) for b in budgets for p in args.presses]:
        for d in names:
            if (m, b, d) not in done:
                tasks.append({"press": m, "budget": b, "doc": d, "prompt_ids": prompts[d],
                              "forced_ids": [] if args.no_ppl else full_runs[d]["token_ids"]})
    t0 = time.perf_counter()
    run_presses([] if args.render_only else tasks, args, results_path, eos)
    wall = time.perf_counter() - t0
    for line in results_path.read_text().splitlines():
        r = json.loads(line)
        done[(r["press"], float(r["budget"]), r["doc"])] = r

    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    text = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    full = {"texts": [text(full_runs[d]["token_ids"]) for d in names],
            "nll": [full_runs[d]["nll"] for d in names], "counts": [len(full_runs[d]["token_ids"]) for d in names]}
    full["ppl"] = math.exp(sum(full["nll"]) / sum(full["counts"]))
    configs: dict[str, Any] = {}
    for p in ALL_POLICIES:  # the variants where they were run
        for b in budgets:
            runs = ks["runs"].get(key(p, b), {})
            if all(d in runs and "token_ids" in runs[d] for d in names):
                nll = [runs[d]["nll"] for d in names] if all("nll" in runs[d] for d in names) else None
                configs[key(p, b)] = score_config([text(runs[d]["token_ids"]) for d in names], nll, full, scorer)
    for p in args.presses:
        for b in budgets:
            rs = [done.get((p, b, d)) for d in names]
            if all(rs):
                nll = None if args.no_ppl else [r["nll"] for r in rs]
                configs[key(PREFIX + p, b)] = score_config([text(r["token_ids"]) for r in rs], nll, full, scorer)
    none_check = None
    nones = [done.get(("none", 1.0, d)) for d in names]
    if all(nones):
        c = score_config([text(r["token_ids"]) for r in nones], None if args.no_ppl else [r["nll"] for r in nones],
                         full, scorer)
        none_check = {"docs": len(names), "rouge2": c["rouge2_mean"], "ppl": c.get("ppl", float("nan")),
                      "ks_ppl": full["ppl"],
                      "same": sum(r["token_ids"] == full_runs[d]["token_ids"] for r, d in zip(nones, names))}
    previous = json.loads(JSON_PATH.read_text()) if JSON_PATH.exists() else {}
    if args.render_only and "kvpress_version" in previous:  # no venv to build just to re-render
        versions = [previous["kvpress_version"], previous["transformers_version"]]
        note = note or previous.get("note", "")
    else:
        versions = subprocess.run([str(kvpress_env.ensure_venv()), "-c",
                                   "import kvpress, transformers, importlib.metadata as m; "
                                   "print(m.version('kvpress'), transformers.__version__)"],
                                  capture_output=True, text=True, env=kvpress_env.clean_env()).stdout.split()
    rep = {"command": command_line(), "date": _dt.date.today().isoformat(), "machine": machine_description(),
           "load_average": load, "threads": args.threads, "wall_s": wall, "note": note,
           "keyserve_command": f"`{ks['command']}`", "keyserve_date": ks["date"],
           "kvpress_version": versions[0] if versions else "?",
           "transformers_version": versions[1] if len(versions) > 1 else "?",
           "max_new_tokens": args.max_new_tokens,
           "budgets": sorted(b for b in budgets if any(key(PREFIX + m, b) in configs for m in args.presses)), "keyserve": [p for p in ALL_POLICIES if any(key(p, b) in configs for b in budgets)],
           "presses": [PREFIX + p for p in args.presses], "docs": [{"name": d, "prompt_tokens": len(prompts[d])} for d in names],
           "configs": configs, "none_check": none_check}
    body = render(rep)
    print(body)
    if not args.no_write:
        JSON_PATH.write_text(json.dumps(rep, indent=1))
        plot(rep, PLOT_PATH)
        update_section("kvpress_anchor", "KV budgets against kvpress (issue 21)", body)


if __name__ == "__main__":
    main()
