"""Peers: keyserve vs llama.cpp vs transformers on SmolLM2-135M-Instruct, side by side, in one run.

1. Builds (once, cached under ~/.cache/keyserve/peers/) a bench-only venv with llama-cpp-python
   and llama-server from the llama.cpp it vendors (bench/peers/build.py), and converts the same
   safetensors keyserve loads into F32 / BF16 GGUFs with llama.cpp's own convert_hf_to_gguf.py;
   the Q4_1 GGUF the default model ships as is run too (bench/peers/ggufs.py).
2. Interleaved rounds (``--rounds``): each runs, in an order rotated per round, the memory read
   bandwidth at ``--threads`` threads and every engine × precision's batch-1 decode and prefill,
   each in its own process (bench/peers/worker.py). The 1-minute load average is read before
   every measurement; a round where any was above ``--max-load`` is dropped (default threads +
   0.5: back-to-back measurements with ``--threads`` threads keep the load near ``--threads``
   by themselves, so only what is above that is other work).
3. Many requests (64 mixed, seeded): keyserve's HTTP server and llama-server (16 slots) driven by
   the same asyncio client at the same concurrency, and transformers' padded ``generate`` and
   continuous batching (bench/peers/servers.py, bench/peers/hf_many.py), each given the same
   time budget with model loading excluded.
4. Writes the tables, the targets of issue 18 (met or missed), a PNG and a JSON dump to
   docs/BENCHMARKS.md, docs/bench_peers.png, docs/bench_peers.json.

    python bench/peer_bench.py [--rounds 3] [--threads 2] [--max-load 2.5] [--quick] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.peers import build, ggufs, hf_many, results, servers  # noqa: E402
from bench.peers.results import Round, contender  # noqa: E402
from bench.workloads import documents, mixed_requests  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"
RESULTS_JSON = DOCS / "bench_peers.json"
PLOT_PNG = DOCS / "bench_peers.png"
WORKER = Path(__file__).resolve().parent / "peers" / "worker.py"
CHAT_PROMPT = "Write a short story about a robot who learns to paint."
SECTION = ("peers", "Peers: keyserve vs llama.cpp vs transformers")
REFERENCE = ("transformers", "float32")  # the oracle the others' greedy tokens are compared with


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="threads for every engine and the bandwidth read")
    ap.add_argument("--max-load", type=float, default=None,
                    help="drop rounds with a 1-min load average above this (default: --threads + 0.5: the "
                         "measurements' own threads keep the load near --threads; more is other work)")
    ap.add_argument("--precisions", nargs="+", default=None, choices=["float32", "bfloat16"],
                    help="keyserve / transformers precisions (default: both; float32 with --quick)")
    ap.add_argument("--llama-half", default="BF16", choices=["BF16", "F16"],
                    help="llama.cpp's 16-bit GGUF compared with keyserve bfloat16")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=1000)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[50, 1000])
    ap.add_argument("--output-range", type=int, nargs=2, default=[16, 256])
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight from the HTTP client")
    ap.add_argument("--slots", type=int, default=16, help="llama-server's parallel slots")
    ap.add_argument("--budget-s", type=float, default=1800,
                    help="seconds each many-request contender gets, model loading excluded")
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16],
                    help="transformers' padded generate: batch sizes tried (the best is reported)")
    ap.add_argument("--skip-many", action="store_true", help="single-stream rounds only")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1 round, 32 decode / 256 prefill tokens, 8 short requests")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.decode_tokens, args.prefill_tokens = 1, 32, 256
        args.num_requests, args.prompt_range, args.output_range = 8, [50, 300], [16, 64]
        args.concurrency, args.budget_s, args.hf_batch_sizes = 8, 300, [8]
    if args.max_load is None:
        args.max_load = args.threads + 0.5
    if args.precisions is None:
        args.precisions = ["float32"] if args.quick else ["float32", "bfloat16"]
    return args


def load_1min() -> float:
    return os.getloadavg()[0]


def contenders(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(engine, precision) in a fixed base order; each round rotates it."""
    half = {"float32": "F32", "bfloat16": args.llama_half}
    out = [c for p in args.precisions for c in (("keyserve", p), ("transformers", p), ("llama.cpp", half[p]))]
    return out + [("llama.cpp", "Q4_1")]


# ----------------------------------------------------------------- single stream
class WorkerFailed(RuntimeError):
    """A worker process ended without a result; ``returncode`` < 0: killed by that signal."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


def run_worker(python: Path, spec: dict, env: dict[str, str], timeout_s: float = 1800) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = dict(env, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false")
    try:
        done = subprocess.run([str(python), str(WORKER), f.name], capture_output=True, text=True, env=env,
                              timeout=timeout_s, cwd=str(WORKER.parent.parent.parent))
    finally:
        os.unlink(f.name)
    for line in done.stdout.splitlines()[::-1]:
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise WorkerFailed(f"worker {spec['engine']} {spec.get('precision', '')} failed (exit {done.returncode}):\n"
                       f"{done.stderr[-3000:]}", done.returncode)


def single_stream_rounds(args, peers: build.Peers, model_dir: Path, gguf_paths: dict[str, Path],
                         decode_ids: list[int], prefill_ids: list[int]) -> list[Round]:
    items: list[tuple[str, str]] = [("bandwidth", "")] + contenders(args)
    ours = Path(sys.executable)
    rounds = []
    with tqdm(total=args.rounds * len(items), desc="rounds", unit="measurement") as bar:
        for r in range(args.rounds):
            rnd = Round(r, 0.0)
            for engine, precision in results.rotation(items, r):
                bar.set_postfix_str(f"round {r + 1}: {engine} {precision}".strip())
                spec = {"engine": engine, "precision": precision, "threads": args.threads,
                        "decode_prompt": decode_ids, "prefill_prompt": prefill_ids,
                        "decode_tokens": args.decode_tokens}
                if engine == "bandwidth":
                    res = run_worker(ours, spec, dict(os.environ))
                    rnd.bandwidth_gbs = res["bandwidth_gbs"]
                    rnd.bandwidth_by_pages = res.get("bandwidth_by_pages", {})
                    rnd.loads.append(res["load"])
                elif engine == "llama.cpp":
                    spec["model"] = str(gguf_paths[precision])
                    try:
                        res = run_worker(peers.python, spec, peers.env())
                    except WorkerFailed as exc:  # a crash: its best working configuration is without repacking
                        if exc.returncode >= 0:
                            raise
                        tqdm.write(f"round {r + 1} llama.cpp {precision} crashed; again with --no-repack: "
                                   f"{str(exc).splitlines()[0]}")
                        res = dict(run_worker(peers.python, dict(spec, no_repack=True), peers.env()),
                                   no_repack=-exc.returncode)
                else:
                    spec["model"] = str(model_dir)
                    res = run_worker(ours, spec, dict(os.environ))
                if engine != "bandwidth":
                    rnd.loads += [res["load_decode"], res["load_prefill"]]
                    rnd.results.append(res)
                    tqdm.write(f"round {r + 1} {engine} {precision}: decode {res['decode_tok_s']:.1f} tok/s, "
                               f"prefill {res['prefill_tok_s']:.0f} tok/s (load {res['load_decode']:.2f})")
                else:
                    by = ", ".join(f"{k} pages {v:.1f}" for k, v in rnd.bandwidth_by_pages.items())
                    tqdm.write(f"round {r + 1} bandwidth: {rnd.bandwidth_gbs:.1f} GB/s ({by}; load {res['load']:.2f})")
                bar.update(1)
            rounds.append(rnd)
    return rounds


# ------------------------------------------------------------------ many requests
def many_requests(args, peers: build.Peers, model_dir: Path, gguf_paths: dict[str, Path],
                  reqs: list[tuple[list[int], int]], logs: Path) -> dict[str, dict]:
    """Per precision: keyserve's server, llama-server, transformers (best of padded / continuous)."""
    half = {"float32": "F32", "bfloat16": args.llama_half}
    out: dict[str, dict] = {}
    for p in args.precisions:
        row: dict[str, dict] = {}
        load = load_1min()
        ks = servers.keyserve_server(p, args.threads, servers.free_port(), max_num_seqs=max(64, args.concurrency))
        row["keyserve"] = dict(servers.run_server(ks, reqs, args.concurrency, args.budget_s, logs / f"keyserve-{p}.log"),
                               load_before=load, config=f"`keyserve serve --no-ray`, max_num_seqs {max(64, args.concurrency)}")
        load = load_1min()
        ls = servers.llama_server(peers.llama_server, gguf_paths[half[p]], args.threads, servers.free_port(), args.slots)
        row["llama-server"] = dict(servers.run_server(ls, reqs, args.concurrency, args.budget_s,
                                                      logs / f"llama-server-{p}.log"),
                                   load_before=load, config=f"{half[p]} GGUF, {args.slots} slots, continuous batching")
        tries = []
        for b in args.hf_batch_sizes:
            load = load_1min()
            spec = {"model": str(model_dir), "dtype": p, "threads": args.threads, "mode": "padded", "batch": b,
                    "requests": reqs}
            tries.append(dict(hf_many.run(sys.executable, spec, args.budget_s, f"transformers padded {b} {p}"),
                              load_before=load, config=f"padded generate, batch {b}"))
        load = load_1min()
        spec = {"model": str(model_dir), "dtype": p, "threads": args.threads, "mode": "continuous", "batch": 0,
                "requests": reqs}
        tries.append(dict(hf_many.run(sys.executable, spec, args.budget_s, f"transformers continuous {p}"),
                          load_before=load, config="continuous batching (generate_batch's manager)"))
        for t in tries:
            t["tok_s"] = results.useful_tok_s(t["tokens"], t["elapsed"])
        row["transformers"] = max(tries, key=lambda t: t["tok_s"] or 0.0)
        row["transformers"]["tries"] = [{k: t[k] for k in ("config", "tok_s", "requests", "elapsed", "error")}
                                        for t in tries]
        for name in ("keyserve", "llama-server"):
            row[name]["tok_s"] = results.useful_tok_s(row[name]["tokens"], row[name]["elapsed"])
        out[p] = row
        tqdm.write(f"many requests {p}: " + ", ".join(f"{k} {v['tok_s'] or 0:.1f} tok/s" for k, v in row.items()))
    return out


# ------------------------------------------------------------------------ report
def did_text(d: dict) -> str:
    """What a many-request contender did, in words (never just 'did not finish')."""
    txt = f"{d['requests']}/{d['total_requests']} requests, {d['tokens']} tokens in {d['elapsed']:.0f} s"
    if not d["finished"]:
        txt += f" (stopped at the {d['budget_s']:.0f} s budget)" if not d.get("error") else f" (error: {d['error']})"
    if d.get("mismatches"):
        txt += f"; {d['mismatches']} with a token count other than asked"
    return txt


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    from bench.report import markdown_table as table  # report.py imports torch: load it only to write

    return table(headers, rows)


def single_table(summary: dict, items: list[tuple[str, str]], bytes_pt: dict[str, int], agree: dict[str, str],
                 reference: tuple[str, str] = REFERENCE) -> str:
    rows = []
    for engine, precision in items:
        s = summary.get(contender(engine, precision))
        if not s:
            continue
        rows.append([contender(engine, precision), s["decode"].text(), s["fraction"].percent() if s["fraction"] else "—",
                     s["prefill"].text(0), f"{bytes_pt.get(precision, 0) / 1e6:.0f}",
                     agree.get(contender(engine, precision), "—")])
    return markdown_table(["engine, precision", "decode tok/s (batch 1)", "decode ÷ bandwidth bound", "prefill tok/s",
                           "weights read per token (MB)", f"greedy tokens equal to {contender(*reference)}"], rows)


def many_table(many: dict[str, dict]) -> str:
    rows = []
    for p, row in many.items():
        for name in ("keyserve", "llama-server", "transformers"):
            d = row[name]
            ratio = results.ratio(row["keyserve"]["tok_s"], d["tok_s"]) if name != "keyserve" else None
            rows.append([p, name, f"{d['tok_s']:.1f}" if d["tok_s"] else "0 (nothing finished)",
                         f"{ratio:.2f}×" if ratio else "—", d["config"], did_text(d), f"{d['load_before']:.2f}"])
    table = markdown_table(["precision", "engine", "useful tok/s", "keyserve ÷ this", "configuration", "what it did",
                            "load before"], rows)
    tries = [f"{p}: " + "; ".join(f"{t['config']} {t['tok_s'] or 0:.1f} tok/s ({t['requests']} requests in "
                                  f"{t['elapsed']:.0f} s{', ' + t['error'] if t['error'] else ''})"
                                  for t in row["transformers"]["tries"]) for p, row in many.items()]
    return table + "\n\ntransformers, every way tried (the best is in the table): " + " — ".join(tries) + "."


def targets_table(targets: list[results.Target]) -> str:
    return markdown_table(["target (issue 18)", "goal", "this run", "verdict"],
                          [[t.what, t.goal, t.measured, t.verdict] for t in targets])


def plot(summary: dict, items: list[tuple[str, str]], bounds: dict[str, float], many: dict, path: Path,
         gguf_name: dict[str, str], title: str = "") -> None:
    """Decode and prefill tok/s per contender (decode with its bandwidth bound), and the
    many-request throughput. ``bounds`` is keyed by GGUF precision; ``gguf_name`` maps
    keyserve's precision names onto those."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [contender(*i) for i in items if contender(*i) in summary]
    colours = {"keyserve": "tab:blue", "llama.cpp": "tab:orange", "transformers": "tab:green"}
    fig, axes = plt.subplots(1, 3 if many else 2, figsize=(16 if many else 11, 4.5))
    for ax, metric, heading in ((axes[0], "decode", "batch-1 decode tok/s"), (axes[1], "prefill", "prefill tok/s")):
        vals = [summary[n][metric].median for n in names]
        ax.bar(range(len(names)), vals, color=[colours[n.split()[0]] for n in names])
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_title(heading)
    # each bar's own bandwidth bound (its precision's bytes per token), as a black tick above it
    ticks = [(i, bounds.get(gguf_name.get(n.split()[1], n.split()[1]))) for i, n in enumerate(names)]
    ticks = [(i, b) for i, b in ticks if b]
    if ticks:
        axes[0].hlines([b for _, b in ticks], [i - 0.45 for i, _ in ticks], [i + 0.45 for i, _ in ticks],
                       colors="black", lw=2, label="bandwidth bound of its precision")
        axes[0].legend(fontsize=7, loc="upper left")
    if many:
        labels, vals, cols = [], [], []
        for p, row in many.items():
            for name in ("keyserve", "llama-server", "transformers"):
                labels.append(f"{name} {p}")
                vals.append(row[name]["tok_s"] or 0.0)
                cols.append(colours["llama.cpp" if name == "llama-server" else name])
        axes[2].bar(range(len(labels)), vals, color=cols)
        axes[2].set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=8)
        axes[2].set_title("many requests: useful (generated) tok/s")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def reference_of(rounds: list[Round]) -> tuple[str, str]:
    """The oracle for greedy tokens: transformers float32, else transformers in what ran."""
    ran = [(res["engine"], res["precision"]) for r in rounds for res in r.results]
    return REFERENCE if REFERENCE in ran else next((c for c in ran if c[0] == "transformers"), REFERENCE)


def agreement_texts(rounds: list[Round]) -> dict[str, str]:
    """Per contender: how many of its first greedy tokens equal the reference's, in its first round."""
    reference = reference_of(rounds)
    ref = next((res["first_tokens"] for r in rounds for res in r.results
                if (res["engine"], res["precision"]) == reference), None)
    out = {}
    for r in rounds[:1]:
        for res in r.results:
            if ref is not None:
                n = results.common_prefix(res["first_tokens"], ref)
                out[contender(res["engine"], res["precision"])] = f"{n}/{min(len(ref), len(res['first_tokens']))}"
    return out


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from keyserve.model.loader import resolve_model_dir

    started = time.perf_counter()
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    model_dir = resolve_model_dir(None)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    peers = build.ensure_peers()
    same = {"float32": "F32", "bfloat16": args.llama_half}  # keyserve's precision -> llama.cpp's GGUF
    gguf_paths = {same[p]: ggufs.convert(peers, model_dir, same[p]) for p in args.precisions}
    gguf_paths["Q4_1"] = ggufs.shipped_q4_1()
    bytes_pt = {name: ggufs.weight_bytes_per_token(ggufs.gguf_tensors(path)) for name, path in gguf_paths.items()}
    bytes_pt.update({p: bytes_pt[same[p]] for p in args.precisions})

    decode_ids = tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]
    corpus = tok.encode("\n\n".join(text for _, text in documents()))
    prefill_ids = corpus[: args.prefill_tokens]

    rounds = single_stream_rounds(args, peers, model_dir, gguf_paths, decode_ids, prefill_ids)
    kept, dropped = results.split_rounds(rounds, args.max_load)
    used = kept or rounds
    summary = results.summarize(used, bytes_pt)
    bw = results.spread([r.bandwidth_gbs for r in used])
    bounds = {p: bw.median * 1e9 / bytes_pt[p] for p in gguf_paths}
    targets = results.decode_targets(summary, args.precisions)

    many: dict[str, dict] = {}
    if not args.skip_many:
        reqs = [(r.prompt_token_ids, r.max_tokens) for r in
                mixed_requests(tok, args.num_requests, tuple(args.prompt_range), tuple(args.output_range), seed=0)]
        logs = peers.root / "logs"
        logs.mkdir(exist_ok=True)
        many = many_requests(args, peers, model_dir, gguf_paths, reqs, logs)
        tput = {p: {k: v["tok_s"] for k, v in row.items()} for p, row in many.items()}
        for p, row in many.items():  # the target is against padded batches: their best size
            padded = [t["tok_s"] for t in row["transformers"]["tries"] if t["config"].startswith("padded") and t["tok_s"]]
            if padded:
                tput[p]["transformers padded"] = max(padded)
        targets += results.throughput_targets(tput, args.precisions)

    items = contenders(args)
    agree = agreement_texts(rounds)
    tables = {"single": single_table(summary, items, bytes_pt, agree, reference_of(rounds)), "many": many_table(many) if many else "",
              "targets": targets_table(targets)}
    print(f"\nbandwidth {bw.text()} GB/s; bounds " + ", ".join(f"{k} {v:.1f}" for k, v in bounds.items()))
    for t in tables.values():
        print("\n" + t)
    if args.no_write:
        return

    load_end = " ".join(f"{x:.2f}" for x in os.getloadavg())
    record = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "argv": sys.argv[1:],
        "args": vars(args), "cpu": cpu_model(), "load_start": load_start, "load_end": load_end,
        "wall_s": time.perf_counter() - started, "build_seconds": build.build_times(peers.root),
        "peers_root": str(peers.root), "ggufs": {k: str(v) for k, v in gguf_paths.items()},
        "bytes_per_token": bytes_pt, "rounds": [vars(r) for r in rounds], "kept_rounds": [r.index for r in kept],
        "bounds_tok_s": bounds, "many": many, "decode_prompt": decode_ids, "prefill_tokens": len(prefill_ids),
        "targets": [vars(t) | {"verdict": t.verdict} for t in targets],
    }
    RESULTS_JSON.write_text(json.dumps(record, indent=1))
    title = (f"SmolLM2-135M-Instruct, {args.threads} threads, {record['cpu']}, {record['date'][:10]}; "
             f"load {load_start} → {load_end}" + ("; SMOKE RUN (--quick), not a measurement" if args.quick else "")
             + ("" if kept else f"; every round above load {args.max_load}"))
    plot(summary, items, bounds, many, PLOT_PNG, same, title)
    from bench.report import update_section  # imports torch: only when writing

    update_section(*SECTION, report_body(args, record, rounds, kept, dropped, bw, bounds, tables))
    print(f"wrote {RESULTS_JSON.name}, {PLOT_PNG.name} and the '{SECTION[1]}' section of docs/BENCHMARKS.md")


def report_body(args, record: dict, rounds: list[Round], kept: list[Round], dropped: list[Round],
                bw: results.Spread, bounds: dict[str, float], tables: dict[str, str]) -> str:
    import transformers

    loads = ", ".join(f"round {r.index + 1}: max {r.max_load:.2f}" for r in rounds)
    if kept:
        rounds_txt = (f"{len(rounds)} round(s) run, {len(kept)} kept, {len(dropped)} dropped for a 1-min load "
                      f"average above {args.max_load} ({loads}).")
    else:
        rounds_txt = (f"**Every one of the {len(rounds)} round(s) had a 1-min load average above {args.max_load} "
                      f"({loads}): the numbers below are from all rounds, unfiltered, and are not a measurement.**")
    smoke = ""
    if args.quick:
        smoke = (f"**Smoke run (`--quick`): {args.rounds} round, {args.decode_tokens} decode / {args.prefill_tokens} "
                 f"prefill tokens, {args.num_requests} short requests, on a shared machine (load {record['load_start']} "
                 f"at the start, {record['load_end']} at the end). It proves the pipeline runs end to end; its numbers "
                 f"are not the comparison. Run without `--quick` on a quiet machine for that.**\n\n")
    builds = ", ".join(f"{k} {v:.0f} s" for k, v in record["build_seconds"].items())
    no_repack = sorted({f"{res['engine']} {res['precision']} (signal {res['no_repack']})"
                        for r in rounds for res in r.results if res.get("no_repack")})
    if no_repack:
        rounds_txt += (f" {', '.join(no_repack)} crashed with llama.cpp's weight repacking on this CPU "
                       f"(its AMX buffers, by the log) and ran with repacking off "
                       f"(`use_extra_bufts = false`, llama-server's `--no-repack`), its best working configuration.")
    used = kept or rounds
    by_pages = {k: results.spread([r.bandwidth_by_pages[k] for r in used if k in r.bandwidth_by_pages])
                for k in ("4k", "huge") if any(k in r.bandwidth_by_pages for r in used)}
    pages_txt = (" (" + ", ".join(f"{'4 KB' if k == '4k' else 'huge'} pages {v.text()}" for k, v in by_pages.items())
                 + ")") if by_pages else ""
    many_txt = ""
    if tables["many"]:
        many_txt = (
            f"### {args.num_requests} requests (prompts {args.prompt_range[0]}–{args.prompt_range[1]} tokens, outputs "
            f"{args.output_range[0]}–{args.output_range[1]}, seeded, greedy, EOS ignored)\n\n"
            f"keyserve's server and llama-server are driven by the same asyncio client with {args.concurrency} "
            f"requests in flight (non-streaming `/v1/completions`, token-id prompts); transformers runs in its own "
            f"process, its best of padded `generate` (batch {', '.join(map(str, args.hf_batch_sizes))}) and its "
            f"continuous batching is shown. Each contender gets {args.budget_s:.0f} s once its model is loaded "
            f"and warmed up (loading excluded); one that runs out of time is reported with what it finished. "
            f"Useful tok/s = generated tokens of finished requests ÷ the time to the last of them.\n\n"
            f"{tables['many']}\n\n")
    return (
        f"{smoke}{args.threads} threads for every engine; SmolLM2-135M-Instruct; CPU: {record['cpu']}; "
        f"load average (1, 5, 15 min) {record['load_start']} at the start, {record['load_end']} at the end; "
        f"wall time {record['wall_s'] / 60:.0f} min. Peers: llama-cpp-python {build.LLAMA_CPP_PYTHON_VERSION} "
        f"and llama-server compiled once from the llama.cpp it vendors (CPU, `GGML_NATIVE=ON`), "
        f"transformers {transformers.__version__} (SDPA). F32 / {args.llama_half} GGUFs converted by that "
        f"llama.cpp's `convert_hf_to_gguf.py` from the safetensors keyserve loads; Q4_1 is the GGUF the model "
        f"ships as. Bench venv and build cached in `{record['peers_root'].replace(str(Path.home()), '~')}` "
        f"(build steps: {builds}).\n\n"
        f"{rounds_txt} Each round runs, in an order rotated per round, a memory-bandwidth read and every "
        f"engine × precision in its own process: same token ids, model loading not timed, the same warm-up "
        f"(an 8-token decode and one prefill), then batch-1 decode ({args.decode_tokens} greedy tokens after a "
        f"{len(record['decode_prompt'])}-token chat prompt, timed from "
        f"the first generated token) and prefill (a {args.prefill_tokens}-token prompt, nothing cached, tok/s = "
        f"prompt tokens ÷ time to first token). Median (low–high) over the rounds used.\n\n"
        f"Memory read bandwidth at {args.threads} threads (torch's sum over a 1 GiB float32 buffer, best of 5, "
        f"on 4 KB pages and on transparent huge pages, the better of the two): {bw.text()} GB/s"
        f"{pages_txt}. Bandwidth bound = that ÷ the bytes of weights one decode step reads (every tensor once; "
        f"the tied embedding is the LM head, so all of it): " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in
                                                                          bounds.items()) + ".\n\n"
        f"### Batch-1 decode and prefill\n\n{tables['single']}\n\n{many_txt}"
        f"### Targets (issue 18)\n\n{tables['targets']}\n\n![peer benchmark](bench_peers.png)\n"
    )


if __name__ == "__main__":
    main()
