"""``LLM.generate`` runs one call at a time: calls from several threads each get what a lone
call gets, a call from inside a running one (a callback) is refused, and neither leaves a
request or a KV block behind."""

from __future__ import annotations

import threading

import pytest

import keyserve.llm as llm_module
from keyserve import LLM, SamplingParams

PROMPTS = ["Once upon a time", "The cat sat", "Lily went to the park", "One day"]
OTHERS = ["Tom and Sue", "A dog ran", "The sun"]
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, seed=7)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def llm(stories_path: str) -> LLM:
    return LLM(stories_path, num_blocks=128)


def tokens(outs: list) -> list[list[int]]:
    return [o.token_ids for o in outs]


def assert_idle(llm: LLM) -> None:
    st = llm.engine.stats()
    assert not llm.engine.requests and st.num_free_blocks == st.num_blocks


def test_generate_from_two_threads_matches_lone_calls(llm: LLM) -> None:
    want = {"a": tokens(llm.generate(PROMPTS, SEEDED)), "b": tokens(llm.generate(OTHERS, GREEDY))}
    got: dict[str, list] = {"a": [], "b": []}

    def run(name: str, prompts: list[str], params: SamplingParams) -> None:
        for _ in range(4):
            try:
                got[name].append(tokens(llm.generate(prompts, params)))
            except Exception as e:  # noqa: BLE001 — recorded, asserted below
                got[name].append(repr(e))

    threads = [threading.Thread(target=run, args=("a", PROMPTS, SEEDED)),
               threading.Thread(target=run, args=("b", OTHERS, GREEDY))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == {"a": [want["a"]] * 4, "b": [want["b"]] * 4}
    assert_idle(llm)


def test_generate_from_a_callback_inside_generate_is_refused(llm: LLM, monkeypatch) -> None:
    outer = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (4, 32)]
    want = tokens(llm.generate(["Once upon a time", "One day"], outer))

    class Bar:  # a progress bar whose update runs the user's code
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def update(self, n: int) -> None:
            llm.generate("The sun", GREEDY)

        def close(self) -> None:
            pass

    monkeypatch.setattr(llm_module, "tqdm", Bar)
    with pytest.raises(RuntimeError, match="inside a running call"):
        llm.generate(["Once upon a time", "One day"], outer, use_tqdm=True)
    monkeypatch.undo()
    assert_idle(llm)
    assert tokens(llm.generate(["Once upon a time", "One day"], outer)) == want


def test_a_second_interrupt_during_clean_up_leaves_nothing_for_the_next_call(llm: LLM, monkeypatch) -> None:
    """Ctrl-C in a step, then again while ``generate`` aborts its requests: some stay queued.
    The next call aborts them before it starts, so it neither runs them (unseen, their outputs
    dropped) nor shares its steps with them, and gives what a lone call gives."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = tokens(llm.generate(PROMPTS, params))
    execute, steps = llm.engine.runner.execute, []

    def interrupted_step(*args: object, **kwargs: object) -> object:
        steps.append(1)
        if len(steps) == 2:
            raise KeyboardInterrupt
        return execute(*args, **kwargs)

    def interrupted_abort(request_id: str) -> None:
        monkeypatch.undo()  # one more Ctrl-C, on the first abort
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.engine.runner, "execute", interrupted_step)
    monkeypatch.setattr(llm.engine, "abort", interrupted_abort)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, params)
    assert len(llm.engine.requests) == len(PROMPTS)  # left queued by the cut-short clean-up
    ran = []
    accept = llm.engine._accept

    def counting_accept(step, out):  # every sequence each step runs
        ran.append(len(step.items))
        return accept(step, out)

    monkeypatch.setattr(llm.engine, "_accept", counting_accept)
    assert tokens(llm.generate(["One day"], params)) == [want[PROMPTS.index("One day")]]
    assert max(ran) == 1  # the leftovers were aborted, not run beside it
    assert_idle(llm)


def test_generate_keeps_the_ends_of_requests_it_does_not_own(llm: LLM) -> None:
    """Requests added with ``engine.add_request`` run to their end inside a ``generate`` call,
    which returns only its own outputs; the others' ends are held for the engine's next step,
    so stepping the engine for them (``run_until_done``) still returns them -- the same
    tokens as alone -- even after another ``generate`` call in between."""
    alone = tokens(llm.generate(OTHERS, GREEDY))
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in OTHERS]
    assert tokens(llm.generate(PROMPTS[:2], GREEDY)) == tokens(llm.generate(PROMPTS[:2], GREEDY))
    assert engine.has_unfinished_requests()
    finished = engine.run_until_done()
    assert sorted(finished) == sorted(ids)
    assert [finished[rid].token_ids for rid in ids] == alone
    assert all(finished[rid].finished for rid in ids)
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert_idle(llm)
