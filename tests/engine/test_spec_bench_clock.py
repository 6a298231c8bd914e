"""bench/spec_bench.py's step clock against a real engine: it wraps the engine's own methods
by name, so a rename in the engine (ModelRunner._sample -> sample did once) must fail here, not
at the start of a bench run. No timing is asserted: only that every phase is seen."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from keyserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.spec_bench import PHASES, StepClock  # noqa: E402


def test_the_step_clock_sees_every_phase_of_plain_and_speculative_steps(stories_path: str, draft_dir: str) -> None:
    llm = LLM(stories_path, num_blocks=200, draft=draft_dir, num_speculative_tokens=2)
    clock = StepClock(llm.engine)
    with torch.inference_mode():
        for speculative in (False, True):
            clock.reset()
            params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, speculative=speculative)
            llm.generate("Once upon a time", params)
            decode = [s for s in clock.steps if "prefill" not in s]
            assert decode, "no decode step was timed"
            seen = set().union(*decode)
            want = {"total", "target", "verify/sample"} | ({"draft", "draft_forward"} if speculative else set())
            assert want <= seen, f"phases never timed: {want - seen}"
            assert set(PHASES[:3]) - {"draft"} <= seen
