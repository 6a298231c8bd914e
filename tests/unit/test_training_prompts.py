"""The draft's training prompts: distinct, deterministic, and never the prompts the acceptance
tool measures on (``HELD_OUT_PROMPTS``; "Why is the sky blue?" used to be in both)."""

from __future__ import annotations

import pytest

from keyserve.training.prompts import HELD_OUT_PROMPTS, build_prompts

BASE_SEED0_DIGEST = "c268a00ccdb8295c"  # sha256 of build_prompts(3540, seed=0), the base set before the wide one
WIDE_SEED8_DIGEST = "a4d1180b0a72d303"  # sha256 of build_prompts(8000, seed=8, "wide"): draft run 8's prompts


def test_held_out_prompts_are_never_trained_on() -> None:
    prompts = build_prompts(3540)
    assert len(set(prompts)) == 3540
    assert not set(prompts) & set(HELD_OUT_PROMPTS)


def test_prompts_are_deterministic_and_refuse_more_than_there_are() -> None:
    assert build_prompts(50, seed=3) == build_prompts(50, seed=3)
    with pytest.raises(ValueError, match="distinct prompts"):
        build_prompts(100_000)


def test_acceptance_measures_on_the_held_out_prompts() -> None:
    from keyserve.training.acceptance import CHAT_PROMPTS

    assert CHAT_PROMPTS == HELD_OUT_PROMPTS


def test_the_wide_set_holds_many_more_prompts_and_keeps_the_bench_out() -> None:
    from keyserve.training.prompts import BENCH_PROMPTS

    wide = build_prompts(15_000, seed=8, prompt_set="wide")
    assert len(set(wide)) == 15_000
    assert not set(wide) & (set(HELD_OUT_PROMPTS) | set(BENCH_PROMPTS))
    assert build_prompts(40, seed=8, prompt_set="wide") == wide[:40]
    # a new seed draws mostly new prompts where the base set redraws nearly the same ones
    other = set(build_prompts(3540, seed=9, prompt_set="wide"))
    assert len(other & set(wide[:3540])) < 0.5 * 3540
    assert len(set(build_prompts(3500, seed=9)) & set(build_prompts(3500, seed=8))) > 0.9 * 3500


def test_the_base_set_replays_draft_runs_1_to_7() -> None:
    """The base set is what the committed draft's runs drew: its first prompts for seed 0 and
    their digest are pinned, so widening the wide set cannot silently change it."""
    import hashlib

    base = build_prompts(3540, seed=0)
    digest = hashlib.sha256("\n".join(base).encode()).hexdigest()[:16]
    assert digest == BASE_SEED0_DIGEST
    wide = build_prompts(8000, seed=8, prompt_set="wide")  # draft run 8 replays too
    assert hashlib.sha256("\n".join(wide).encode()).hexdigest()[:16] == WIDE_SEED8_DIGEST
    with pytest.raises(ValueError, match="prompt set"):
        build_prompts(10, prompt_set="narrow")


def test_the_spec_bench_measures_on_the_prompts_the_wide_set_keeps_out() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.spec_bench import PROMPTS

    from keyserve.training.prompts import BENCH_PROMPTS

    assert PROMPTS == BENCH_PROMPTS and len(BENCH_PROMPTS) == 16


def test_distill_options_check_the_prompt_set(tmp_path) -> None:  # noqa: ANN001
    from keyserve.training.distill import DistillOptions

    assert DistillOptions(out=str(tmp_path / "x")).prompt_set == "wide"
    with pytest.raises(ValueError, match="--prompt-set must be one of base, wide"):
        DistillOptions(out=str(tmp_path / "x"), prompt_set="narrow")


def test_acceptance_can_measure_on_the_bench_prompts() -> None:
    from keyserve.training.acceptance import PROMPT_CHOICES

    from keyserve.training.prompts import BENCH_PROMPTS

    assert PROMPT_CHOICES == {"held-out": HELD_OUT_PROMPTS, "bench": BENCH_PROMPTS}
