"""The target's answers by keyserve's own engine, with its top-k distribution before every token.

``generate.py`` decodes over a dense, contiguous KV cache in float32: exact, but on 2 CPU cores
it makes ~200 tokens/s. The serving engine (paged KV, continuous batching, the native decode
kernels) makes ~875 tokens/s in float32 and ~1000 in bfloat16 on the same cores
(bench/distill_data_bench.py), returning each token's raw (T = 1) top log-probabilities through
the public ``top_logprobs`` option, so the distillation data costs a fraction of the time. What
it gives up: at most ``MAX_TOP_LOGPROBS`` (20) alternatives per position instead of 32, and in
bfloat16 the distributions are the bfloat16 target's (their top-1 is float32's at ~97 % of
positions; ``python -m keyserve.training.acceptance`` judges the draft against float32).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from keyserve.core.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from keyserve.engine.llm_engine import LLMEngine
from keyserve.engine.outputs import RequestOutput
from keyserve.training.corpus import Item
from keyserve.training.generate import GenerationJob
from keyserve.training.records import Answer


def _params(job: GenerationJob, i: int) -> SamplingParams:
    """Prompt ``i``'s request: its temperature, seeded per prompt (a rerun draws the same)."""
    return SamplingParams(
        max_tokens=job.max_new_tokens,
        temperature=job.temperatures[i],
        seed=job.seed * 1_000_003 + job.indices[i],
        top_logprobs=job.top_k,
        stop_token_ids=sorted(job.stop_ids),
    )


def _top_tensors(
    tops: list[list[tuple[int, float]]],  # per position: (token id, logprob), most likely first
) -> tuple[torch.Tensor, torch.Tensor]:  # ids [n, k] int32, logprobs [n, k] float16
    """The engine's per-position alternatives as a record's ``topk_ids`` / ``topk_logprobs``."""
    ids = torch.tensor([[t for t, _ in row] for row in tops], dtype=torch.int32)
    lps = torch.tensor([[lp for _, lp in row] for row in tops], dtype=torch.float32)
    return ids, lps.to(torch.float16)


def _answer(job: GenerationJob, i: int, out: RequestOutput) -> Answer | None:
    """The record of one finished request; None for an empty answer (nothing to learn from)."""
    completion = out.outputs[0]
    tops = completion.top_logprobs or []
    if not completion.token_ids or len(tops) != len(completion.token_ids):
        return None
    return Answer(job.indices[i], list(job.prompts[i]), list(completion.token_ids), *_top_tensors(tops))


def engine_answers(
    engine: LLMEngine,
    job: GenerationJob,
    deadline: float,
    on_save: Callable[[list[Answer]], None],
    save_every_s: float = 60.0,
) -> int:
    """Answer every prompt of ``job`` with ``engine`` (all queued at once: it keeps
    ``max_num_seqs`` running and refills finished slots, as serving does). Finished answers go to
    ``on_save`` about every ``save_every_s`` seconds; once ``deadline`` (a ``time.monotonic()``
    value) passes, the requests still queued or running are aborted and dropped. Returns the
    tokens recorded."""
    if not 1 <= job.top_k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"the engine records 1 to {MAX_TOP_LOGPROBS} alternatives per token, not {job.top_k}")
    row_of = {engine.add_request(list(p), _params(job, i), prompt_token_ids=list(p)): i
              for i, p in enumerate(job.prompts)}
    pending: list[Answer] = []
    generated, last_save, start = 0, time.monotonic(), time.monotonic()
    bar = tqdm(total=len(row_of), desc="target answers (engine)", unit="prompt", dynamic_ncols=True)
    try:
        while engine.has_unfinished_requests() and time.monotonic() <= deadline:
            for out in engine.step():
                if not out.finished or out.request_id not in row_of:
                    continue
                bar.update(1)
                answer = _answer(job, row_of.pop(out.request_id), out)
                if answer is not None:
                    pending.append(answer)
                    generated += len(answer.tokens)
            bar.set_postfix(tok_s=f"{generated / max(time.monotonic() - start, 1e-9):.0f}")
            if pending and time.monotonic() - last_save > save_every_s:
                on_save(pending)
                pending, last_save = [], time.monotonic()
    finally:
        for rid in row_of:  # out of time (or interrupted): what is unfinished is not recorded
            engine.abort(rid)
        bar.close()
    if pending:
        on_save(pending)
    return generated


def engine_teacher_force(
    engine: LLMEngine,
    items: list[Item],
    top_k: int,
) -> list[Answer]:
    """The target's top-k before every passage token, as ``corpus.teacher_force`` records them,
    from the engine's prefill: each item runs as one prompt (its ids, then the passage's) with
    ``prompt_logprobs``, so a passage costs prefill rows (~1200 tokens/s in bfloat16 on the Zen 5
    against ~480 in float32), not one decode step per token."""
    if not 1 <= top_k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"the engine records 1 to {MAX_TOP_LOGPROBS} alternatives per token, not {top_k}")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k)
    rows = {engine.add_request(p + t, params, prompt_token_ids=p + t): n for n, (_, p, t) in enumerate(items)}
    done: dict[str, RequestOutput] = {}
    try:
        while len(done) < len(rows):
            done.update((o.request_id, o) for o in engine.step() if o.finished and o.request_id in rows)
    finally:
        for rid in rows.keys() - done.keys():
            engine.abort(rid)
    answers = []
    for rid, n in rows.items():
        index, prompt, passage = items[n]
        tops = done[rid].prompt_top_logprobs[len(prompt) : len(prompt) + len(passage)]  # before each passage token
        answers.append(Answer(index, list(prompt), list(passage), *_top_tensors(tops)))
    return answers
