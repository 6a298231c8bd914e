"""transformers on many requests, in a child process that reports as it goes, so a run stopped at
its time budget still says what it did.

Two ways, each transformers' own:
* ``padded``: ``generate`` over batches of ``batch`` requests (left padding, every row of a
  batch decodes as long as its longest request; only each request's own tokens count as useful);
* ``continuous``: transformers' continuous batching (the manager behind ``generate_batch``),
  each request with its own ``max_new_tokens`` and EOS off.

The child prints ``{"loaded": ...}`` once the model is loaded and warmed up; the parent starts
the budget's clock only then (model loading excluded), then reads progress lines
``{"tokens", "requests", "elapsed"}`` until the child finishes or the budget runs out.

    python bench/peers/hf_many.py SPEC.json     # the child; SPEC: model, dtype, threads, mode,
                                                # batch, requests [[prompt ids, max tokens], ...],
                                                # device ("cpu" unless given)
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def child(spec: dict) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
    from transformers import AutoModelForCausalLM, GenerationConfig

    device = spec.get("device", "cpu")
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=getattr(torch, spec["dtype"]), attn_implementation="sdpa").to(device).eval()
    reqs = [(list(p), int(n)) for p, n in spec["requests"]]
    pad = 0
    # warm-up, the same for both modes: one short generate
    with torch.no_grad():
        model.generate(torch.tensor([reqs[0][0][:16]], device=device), max_new_tokens=4, do_sample=False,
                       pad_token_id=pad)
    if spec["mode"] == "padded":
        _emit(loaded=True)
        _padded(model, reqs, spec["batch"], pad)
    else:
        _continuous(model, reqs, GenerationConfig)


def _padded(model, reqs: list[tuple[list[int], int]], batch: int, pad: int) -> None:
    import torch

    t = time.perf_counter()
    tokens = done = 0
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        n = max(m for _, m in chunk)
        ids, mask = ids.to(model.device), mask.to(model.device)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=pad)
        tokens += sum(m for _, m in chunk)
        done += len(chunk)
        _emit(tokens=tokens, requests=done, elapsed=time.perf_counter() - t)


def _continuous(model, reqs: list[tuple[list[int], int]], GenerationConfig) -> None:
    from transformers.generation.continuous_batching.utils import WorkloadHints

    cfg = GenerationConfig(max_new_tokens=max(n for _, n in reqs), do_sample=False, eos_token_id=-1)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p, _ in reqs),
                          max_generated_length=max(n for _, n in reqs), num_requests=len(reqs))
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5,
                                                    workload_hints=hints) as manager:
        _emit(loaded=True)
        t = time.perf_counter()
        for k, (p, n) in enumerate(reqs):
            manager.add_request(input_ids=p, request_id=f"r{k}", max_new_tokens=n, eos_token_id=-1)
        tokens = done = 0
        while done < len(reqs):
            res = manager.get_result(timeout=1)
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped")
                continue
            if res.is_finished():
                tokens += len(res.generated_tokens)
                done += 1
                _emit(tokens=tokens, requests=done, elapsed=time.perf_counter() - t)


def run(python: str, spec: dict, budget_s: float, desc: str = "transformers", load_timeout_s: float = 600) -> dict:
    """Run the child under ``python``; give it ``budget_s`` seconds once it is loaded. Returns
    ``{tokens, requests, total_requests, elapsed, finished, error}`` — what it did by the end."""
    from tqdm import tqdm

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false")
    errlog = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty child never blocks on it
    proc = subprocess.Popen([python, str(Path(__file__).resolve()), f.name], stdout=subprocess.PIPE,
                            stderr=errlog, text=True, env=env)
    total = len(spec["requests"])
    last = {"tokens": 0, "requests": 0, "elapsed": 0.0}
    loaded_at = None
    started = time.perf_counter()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    error = None
    with tqdm(total=total, desc=desc, unit="req") as bar:
        try:
            while True:
                now = time.perf_counter()
                if loaded_at is None and now - started > load_timeout_s:
                    error = f"not loaded in {load_timeout_s:.0f} s"
                    break
                if loaded_at is not None and now - loaded_at > budget_s:
                    break
                if not sel.select(timeout=1.0):
                    if proc.poll() is not None:
                        break
                    continue
                line = proc.stdout.readline()
                if not line:
                    break
                if not line.startswith("{"):
                    continue
                msg = json.loads(line)
                if msg.get("loaded"):
                    loaded_at = time.perf_counter()
                    continue
                if msg["elapsed"] > budget_s:  # finished after the budget: does not count
                    break
                last = msg
                bar.update(msg["requests"] - bar.n)
        finally:
            proc.kill()
            proc.wait()
            os.unlink(f.name)
    errlog.seek(0)
    err_tail = errlog.read().strip().splitlines()[-1:]
    errlog.close()
    finished = last["requests"] == total
    if not finished and error is None and proc.returncode not in (0, -9):
        error = err_tail[0] if err_tail else f"exit {proc.returncode}"
    if loaded_at is not None and last["requests"] == 0:  # nothing finished: it ran the whole budget
        last = dict(last, elapsed=min(budget_s, time.perf_counter() - loaded_at))
    return {"tokens": last["tokens"], "requests": last["requests"], "total_requests": total,
            "elapsed": last["elapsed"], "finished": finished, "budget_s": budget_s, "error": error}


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        child(json.load(fh))
