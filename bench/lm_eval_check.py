"""lm-eval (EleutherAI's evaluation harness) against keyserve's OpenAI server.

lm-eval's ``local-completions`` backend scores loglikelihood tasks through completions' ``echo``
with ``logprobs`` (token-id prompts, ``max_tokens=1``, the continuation's entries read from the
context's length on). Its own ``hf`` backend computes the same quantities with transformers. Both
run here on the same weights and the same local task, each document's (loglikelihood,
is_greedy) compared: the server's must equal transformers' to float rounding.

lm-eval runs from a bench-only venv (``bench/peers/bench_venv.py``: it brings its own stack),
keyserve from ours (``keyserve serve --no-ray``). The task is written here: ``--docs``
continuations of short stories in stories260K's domain (a context sentence, then the next
words), so no dataset is downloaded.

    python bench/lm_eval_check.py [--model PATH] [--docs 64] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.peers import bench_venv  # noqa: E402
from bench.peers.servers import free_port, keyserve_server, start, stop  # noqa: E402
from bench.report import markdown_table, update_section  # noqa: E402

LM_EVAL = ("lm-eval[api,hf]==0.4.13",)
STORIES = Path(os.environ.get("KEYSERVE_STORIES260K", Path(__file__).resolve().parents[2] / "shared" / "models"
                              / "stories260k"))
TASK = "keyserve_loglikelihood"
NAMES = ["Lily", "Tom", "Sue", "Ben", "Max", "Mia"]
PLACES = ["the park", "the garden", "the big tree", "the lake", "her house", "the shop"]
THINGS = ["a red ball", "a little dog", "a big box", "a shiny stone", "a toy car", "a blue kite"]


def documents(count: int, seed: int = 0) -> list[dict]:
    """``count`` (context, continuation) pairs: a story's first sentence, then its next words."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        name, place, thing = rng.choice(NAMES), rng.choice(PLACES), rng.choice(THINGS)
        context = f"Once upon a time, there was a girl named {name}. One day, {name} went to {place}."
        continuation = rng.choice([f" She saw {thing}.", f" {name} found {thing} there.",
                                   f" It was a sunny day and {name} was happy.", f" {name} wanted to play with {thing}."])
        docs.append({"context": context, "continuation": continuation})
    return docs


def write_task(folder: Path, docs: list[dict]) -> None:
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: loglikelihood\n"
        "doc_to_text: \"{{context}}\"\n"
        "doc_to_target: \"{{continuation}}\"\n"
        "target_delimiter: \"\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )


def run_lm_eval(python: Path, model: str, model_args: str, task_dir: Path, out: Path, threads: int) -> tuple[list, dict, float]:
    """One lm-eval run: per-document (loglikelihood, is_greedy) in document order, the task's
    metrics, and the wall time."""
    cmd = [str(python), "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", TASK,
           "--include_path", str(task_dir), "--log_samples", "--output_path", str(out), "--batch_size", "1",
           "--device", "cpu"]
    env = dict(bench_venv.clean_env(), OMP_NUM_THREADS=str(threads), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    t = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if done.returncode:
        raise RuntimeError(f"lm-eval ({model}) failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    samples = sorted(out.rglob(f"samples_{TASK}_*.jsonl"))[-1]
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    rows.sort(key=lambda r: r["doc_id"])
    # each sample's response: [loglikelihood, is_greedy], written as strings by this lm-eval
    resps = [(float(r["resps"][0][0][0]), str(r["resps"][0][0][1]) == "True") for r in rows]
    results = json.loads(sorted(out.rglob("results_*.json"))[-1].read_text())["results"][TASK]
    return resps, results, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(STORIES), help="a Hugging Face model directory (both sides load it)")
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    python = bench_venv.ensure_venv("lm-eval", LM_EVAL)
    docs = documents(args.docs)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_task(work, docs)
        port = free_port()
        server = keyserve_server("float32", args.threads, port, model=args.model)
        start(server, work / "server.log")
        try:
            served = httpx.get(server.base + "/v1/models", timeout=30).json()["data"][0]["id"]
            ours, our_metrics, our_wall = run_lm_eval(
                python, "local-completions",
                f"model={served},base_url={server.base}/v1/completions,tokenizer={args.model},"
                "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1,add_bos_token=True",
                work, work / "keyserve", args.threads)
        finally:
            stop(server)
        hf, hf_metrics, hf_wall = run_lm_eval(python, "hf", f"pretrained={args.model},dtype=float32,add_bos_token=True",
                                              work, work / "hf", args.threads)
    diffs = [abs(a[0] - b[0]) for a, b in zip(ours, hf, strict=True)]
    greedy_same = sum(a[1] == b[1] for a, b in zip(ours, hf))
    table = markdown_table(
        ["backend", "documents", "acc (continuation is greedy)", "mean loglikelihood", "wall s"],
        [["lm-eval local-completions -> keyserve serve", len(ours), f"{our_metrics['acc,none']:.4f}",
          f"{sum(r[0] for r in ours) / len(ours):.4f}", f"{our_wall:.1f}"],
         ["lm-eval hf (transformers)", len(hf), f"{hf_metrics['acc,none']:.4f}",
          f"{sum(r[0] for r in hf) / len(hf):.4f}", f"{hf_wall:.1f}"]])
    verdict = (f"Per document: max |Δ loglikelihood| {max(diffs):.2e} (mean {sum(diffs) / len(diffs):.2e}); "
               f"is_greedy equal in {greedy_same}/{len(ours)}.")
    print(table)
    print(verdict)
    if args.no_write:
        return
    body = (f"lm-eval {LM_EVAL[0].split('==')[1]} from its bench-only venv, the same local loglikelihood task "
            f"({args.docs} story continuations, `{Path(args.model).name}`, float32) through its `local-completions` "
            "backend against `keyserve serve --no-ray` (completions' `echo` with `logprobs`: the prompt's "
            "log-probabilities) and through its own `hf` backend (transformers). Wall times include each "
            "backend's start.\n\n" + table + "\n\n" + verdict + "\n")
    update_section("lm_eval", "lm-eval against the server: prompt log-probabilities", body)


if __name__ == "__main__":
    main()
