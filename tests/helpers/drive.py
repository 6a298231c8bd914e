"""Drive an engine's requests to the end with one action in the middle (a fault, late arrivals):
the loop the fault tests share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def run_with_action(
    engine: Any,  # an LLMEngine or RayEngine: add_request / step / has_unfinished_requests
    prompts: Sequence[str],
    params: Sequence[Any],  # SamplingParams, one per prompt
    action: Callable[[], list[str] | None],
    at_step: int,
    max_steps: int = 400,
) -> list[Any]:  # the finished RequestOutputs, in the order the requests were added
    """Add the requests, step until none is unfinished, and call ``action`` once after step
    ``at_step``; the ids of requests it adds (if it returns any) join the result."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        assert steps < max_steps, "requests that never finished (lost on the way to the engine?)"
        if steps == at_step:
            ids += action() or []
    return [done[rid] for rid in ids]
