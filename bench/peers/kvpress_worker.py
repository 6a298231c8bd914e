"""Runs in the kvpress bench venv (``bench/peers/kvpress_env.py``): only the standard library,
torch, transformers and kvpress. One process, one model; for every task a press compresses the
prompt's KV during prefill (kvpress compresses the prefill only: generated tokens are kept), then

- greedy decoding of up to ``max_new_tokens`` tokens (EOS ends, and is kept, as keyserve does);
- the teacher-forced NLL of the full-attention output, from a copy of the same compressed cache.

    python kvpress_worker.py JOB.json RESULTS.jsonl

JOB: {"model_dir", "threads", "max_new_tokens", "eos_token_id", "tasks": [{"press", "budget",
"doc", "prompt_ids", "forced_ids"}]}; one JSON line per finished task is appended to RESULTS
({"press", "budget", "doc", "token_ids", "nll", "kv_tokens_held", "seconds"}), so an interrupted
run loses at most the task in flight. ``press`` "none" is plain dense attention (the check that
this model and these prompts give keyserve's full-attention output).
"""

from __future__ import annotations

import copy
import json
import sys
import time

import torch
import transformers


def make_press(name: str, budget: float):
    """The kvpress press of that name keeping ``budget`` of the prompt (None: no press)."""
    import kvpress

    ratio = 1.0 - budget  # kvpress: the fraction removed
    presses = {
        "streaming_llm": lambda: kvpress.StreamingLLMPress(compression_ratio=ratio),
        "observed_attention": lambda: kvpress.ObservedAttentionPress(compression_ratio=ratio),
        "snapkv": lambda: kvpress.SnapKVPress(compression_ratio=ratio),
        "tova": lambda: kvpress.TOVAPress(compression_ratio=ratio),
        "expected_attention": lambda: kvpress.ExpectedAttentionPress(compression_ratio=ratio),
        "knorm": lambda: kvpress.KnormPress(compression_ratio=ratio),
    }
    if name in ("h2o_prompt", "last_query", "h2o_shared", "last_query_shared"):
        return _ablation_press(ratio, last=1 if name.startswith("last_query") else 0, shared=name.endswith("_shared"))
    return None if name == "none" else presses[name]()


def _ablation_press(ratio: float, last: int, shared: bool = False, recent_ratio: float = 0.3):
    """keyserve's prompt-phase rule as a press (ablations, not kvpress's own): per kv-head, the
    attention of the prompt's queries summed over the group's query heads (``last`` > 0: only the
    last ``last`` queries, TOVA's window), the round(0.3 k) most recent tokens always kept, the
    top of the rest by that score. Decoding then keeps every generated token, as with any press:
    ``h2o_prompt`` beside keyserve's h2o isolates the decode-phase evictions, ``last_query``
    beside ``h2o_prompt`` the prompt-phase scoring window. ``shared``: one selection per layer,
    from the score averaged over all its query heads (TOVA's pooling), instead of per kv-head."""
    import math
    from dataclasses import dataclass

    import kvpress
    from kvpress.utils import compute_n_kept

    @dataclass
    class RecentPlusScore(kvpress.ScorerPress):
        last: int = 0
        shared: bool = False

        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            assert attentions is not None, "needs eager attention"
            a = attentions[:, :, -self.last :, :] if self.last else attentions  # [B, Hq, q, n]
            bsz, num_kv, n, _ = keys.shape
            s = a.sum(2).view(bsz, num_kv, -1, n).sum(2).float()  # [B, Hkv, n]
            if self.shared:  # every kv-head of the layer keeps the same tokens
                s = s.mean(1, keepdim=True).expand(-1, num_kv, -1).clone()
            k = compute_n_kept(n, self.compression_ratio)
            w = max(0, min(k, int(math.floor(recent_ratio * k + 0.5))))
            if w:
                s[..., n - w :] = s.max() + 1.0
            return s

    return RecentPlusScore(compression_ratio=ratio, last=last, shared=shared)


@torch.no_grad()
def run_task(model, task: dict, max_new_tokens: int, eos: int) -> dict:
    t0 = time.perf_counter()
    ids = torch.tensor([task["prompt_ids"]])
    cache = transformers.DynamicCache(config=model.config)
    press = make_press(task["press"], task["budget"])
    if press is None:
        out = model(ids, past_key_values=cache, use_cache=True)
    else:
        with press(model):
            out = model(ids, past_key_values=cache, use_cache=True)
    held = cache.get_seq_length()
    n = ids.shape[1]  # tokens after the prompt sit at their true positions (as kvpress's pipeline
    # passes them), not at the compressed cache's length
    forced = task["forced_ids"]
    nll = None
    if forced:
        tf_cache = copy.deepcopy(cache)
        logp = [torch.log_softmax(out.logits[0, -1].float(), -1)]
        if len(forced) > 1:
            tf = model(torch.tensor([forced[:-1]]), past_key_values=tf_cache, use_cache=True,
                       position_ids=torch.arange(n, n + len(forced) - 1)[None])
            logp += list(torch.log_softmax(tf.logits[0].float(), -1))
        nll = -sum(float(lp[t]) for lp, t in zip(logp, forced))
    tokens: list[int] = []
    logits = out.logits[0, -1]
    while True:
        tok = int(logits.argmax())
        tokens.append(tok)
        if tok == eos or len(tokens) >= max_new_tokens:
            break
        logits = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True,
                       position_ids=torch.tensor([[n + len(tokens) - 1]])).logits[0, -1]
    return {"press": task["press"], "budget": task["budget"], "doc": task["doc"], "token_ids": tokens,
            "nll": nll, "kv_tokens_held": held, "seconds": time.perf_counter() - t0}


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(job["threads"])
    # Eager attention for every press: ObservedAttention needs the attention weights.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        job["model_dir"], dtype=torch.float32, attn_implementation="eager").eval()
    tasks = job["tasks"]
    t0 = time.perf_counter()
    with open(sys.argv[2], "a") as f:
        for i, task in enumerate(tasks):
            res = run_task(model, task, job["max_new_tokens"], job["eos_token_id"])
            f.write(json.dumps(res) + "\n")
            f.flush()
            left = (time.perf_counter() - t0) / (i + 1) * (len(tasks) - i - 1)
            print(f"kvpress {i + 1}/{len(tasks)} {task['press']}@{task['budget']:g} {task['doc']}: "
                  f"{res['seconds']:.1f} s, ~{left / 60:.0f} min left", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
