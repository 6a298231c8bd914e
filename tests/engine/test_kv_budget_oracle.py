"""H2O and Keyformer in the engine, step by step, against an independent dense replay.

``tests/helpers/dense_budget_oracle.py`` reruns a budgeted request with transformers' modules
over a dense K/V and recomputes, in plain torch, per (layer, kv-head): which position sits in
which slot, the accumulated scores S (Keyformer: the same Gumbel noise, ``kernels/noise.py``,
at the schedule's τ), the prompt selection and its compaction, each decode step's victim, and
the settling of a speculative verification. After every engine step the engine's budget state
must hold the same position in every slot with the same S (to float rounding), and every
generated token must be the replay's greedy token. A near-tie (two candidates' S within 1e-5
relative at the cut) may go either way under float summation order: there the replay takes the
engine's choice, at most twice a request.

Mutations caught (each applied by hand, seen to fail, reverted):

- skipping the decode-phase score accumulation (``KVBudgetTracker.accumulate_step`` adding only
  prefill rows): S differs after the first decode step, in every test;
- forcing τ = 1 (``kv_budget.keyformer.tau`` returning 1.0): Keyformer's S differs after the
  second decode step (τ = 1 at the first), and after the first verification;
- skipping the prompt-phase score accumulation: the prompt selection keeps other positions;
- the prompt's Keyformer noise keyed one position off (``SlotPlanner``'s noise rows): the
  prompt selection differs;
- evicting the highest S instead of the lowest (``choose_victims_one``): the slot map after the
  first decode step;
- the new token keeping its victim's score instead of starting from its own
  (``KVBudgetState._write_new``): S after the first decode step;
- accumulating every verified row, rejected drafts included (``KVBudgetTracker.settle``): S
  after the first verification with a rejection (speculative tests only).

The scoring options (``kv_score_window="last"`` and ``"mean"``, ``kv_score_pooling="layer"``; the replay
follows them in ``_attend``), mutations caught:

- the prompt's last token not held back for a step of its own (``scheduler._hold_back_last``
  returning n): the "last" prompt selections keep other positions (every "last" test);
- S added to instead of replaced under "last" (``KVBudgetState.accumulate``): every "last" test;
- no pooling (``pool_over_layer`` returning the scores unchanged): every "layer" test;
- a verification settled with its first accepted row's scores instead of the newest's
  (``KVBudgetTracker.settle``): the speculative "last" tests;
- ``kv_score_window="mean"`` ranking by S itself (``KVBudgetState.ranking`` ignoring it): the
  "mean" tests' slot maps; counting one query too many per token (``mean_attention`` dividing by
  ``next_position - positions + 1``): the "mean" tests' slot maps.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.dense_budget_oracle import DenseBudgetOracle

from keyserve import LLM, SamplingParams

PROMPT = (
    "Once upon a time there was a little girl named Lily. She loved to play outside in the park. "
    "One day she saw a big red ball and she wanted to play with it."
)
MAX_TOKENS = 24
SEED = 5


@pytest.fixture(scope="module")
def hf(stories_path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(stories_path: str) -> LLM:
    return LLM(stories_path, num_blocks=256, block_size=8)


@pytest.fixture(scope="module")
def speculative(stories_path: str, draft_dir: str) -> LLM:
    return LLM(stories_path, num_blocks=256, block_size=8, draft=draft_dir, num_speculative_tokens=3)


def _params(policy: str, k: int, window: str = "all", pooling: str = "kv_head") -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, seed=SEED, ignore_eos=True,
                          kv_policy=policy, kv_budget=k, recent_ratio=0.3, kv_score_window=window,
                          kv_score_pooling=pooling)


class _Snapshots:
    """Spies (the real methods run unchanged) that keep a copy of one sequence's budget state
    where the engine has just settled it: after every step (read by the test), after a
    speculative settle, and as the state is released when the request finishes."""

    def __init__(self, llm: LLM, seq_id: int) -> None:
        self.tracker = llm.engine.runner.budget
        self.seq_id = seq_id
        self.settled: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.released: tuple[torch.Tensor, torch.Tensor] | None = None
        self.prompt: tuple[torch.Tensor, torch.Tensor] | None = None  # after the prompt, if seen
        self.items: list[tuple[int, int, bool, int | None]] = []  # (start, queries, verifies, accepted)
        self._settle, self._release, self._execute = (self.tracker.settle, self.tracker.release_id,
                                                      llm.engine.runner.execute)
        self.runner = llm.engine.runner

    def snap(self) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.tracker.states[self.seq_id]
        return state.positions.clone().cpu(), state.scores.clone().cpu()

    def __enter__(self) -> "_Snapshots":
        def settle(seq, num_tokens):
            keep = self._settle(seq, num_tokens)
            if seq.seq_id == self.seq_id:
                self.settled.append(self.snap())
            return keep

        def release_id(seq_id):
            if seq_id == self.seq_id and seq_id in self.tracker.states:
                self.released = self.snap()
            self._release(seq_id)

        def execute(step, *args, **kwargs):
            out = self._execute(step, *args, **kwargs)
            self.items += [(it.start, it.num_query_tokens, it.verifies, out.num_accepted.get(it.seq_id))
                           for it in step.items if it.seq_id == self.seq_id]
            return out

        self.tracker.settle, self.tracker.release_id, self.runner.execute = settle, release_id, execute
        return self

    def __exit__(self, *exc: object) -> None:
        del self.tracker.settle, self.tracker.release_id, self.runner.execute


def _same_state(got: tuple[torch.Tensor, torch.Tensor], oracle: DenseBudgetOracle, what: str) -> None:
    positions, scores = got
    want = oracle.positions()
    assert torch.equal(positions, want), f"{what}: kept positions per slot differ"
    torch.testing.assert_close(scores, oracle.scores(), atol=2e-5, rtol=2e-5, msg=lambda m: f"{what}: S: {m}")


def _run(llm: LLM, hf, policy: str, k: int, window: str = "all",
         pooling: str = "kv_head") -> tuple[list[int], list[int], _Snapshots, list]:
    """Step the engine over one request; after each step keep its budget state."""
    engine = llm.engine
    rid = engine.add_request(PROMPT, _params(policy, k, window, pooling))
    seq_id = engine.requests[rid].seqs[0].seq_id
    after_step = []
    with _Snapshots(llm, seq_id) as snaps:
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out
            if seq_id in engine.runner.budget.states and seq_id not in engine.runner.budget.pending:
                after_step.append((len(done[rid].token_ids), snaps.snap()))
    out = done[rid]
    return out.prompt_token_ids, out.token_ids, snaps, after_step


OPTIONS = [("all", "kv_head"), ("last", "kv_head"), ("all", "layer"), ("last", "layer"), ("mean", "kv_head")]


@pytest.mark.parametrize("policy", ["h2o", "keyformer"])
@pytest.mark.parametrize("k", [12, 0.5])
@pytest.mark.parametrize("options", OPTIONS, ids=["-".join(o) for o in OPTIONS])
def test_every_step_equals_the_dense_replay(llm: LLM, hf, policy: str, k: float, options: tuple[str, str]) -> None:
    """Prompt phase, then every decode step: kept positions per slot, S, and the token; with
    each combination of the scoring options (``kv_score_window``, ``kv_score_pooling``)."""
    window, pooling = options
    prompt, tokens, snaps, after_step = _run(llm, hf, policy, k, window, pooling)
    budget = k if k > 1 else max(1, round(k * len(prompt)))
    oracle = DenseBudgetOracle(hf, policy, int(budget), 0.3, SEED, MAX_TOKENS, window=window, pooling=pooling)
    assert len(prompt) > budget + 10 and len(tokens) == MAX_TOKENS
    states = dict(after_step)  # tokens generated so far -> state after that step
    states[len(tokens)] = snaps.released
    logits = oracle.prompt(prompt, follow=states[1][0])
    for i, token in enumerate(tokens):
        assert int(logits.argmax()) == token, f"token {i}"
        _same_state(states[i + 1], oracle, f"after {'the prompt' if i == 0 else f'decode step {i}'}")
        if i + 1 < len(tokens):
            logits = oracle.decode(token, step=i, follow=states[i + 2][0])
    evicted = len(prompt) + len(tokens) - 1 - budget
    assert evicted > 20
    assert oracle.ties_followed <= 2, "near-ties are rare; many mean the scores drift"


@pytest.mark.parametrize("policy", ["h2o", "keyformer"])
@pytest.mark.parametrize("options", [OPTIONS[0], OPTIONS[3], OPTIONS[4]], ids=["all-kv_head", "last-layer", "mean-kv_head"])
def test_speculative_verifications_equal_the_dense_replay(speculative: LLM, hf, policy: str,
                                                          options: tuple[str, str]) -> None:
    """A target under a budget that verifies a draft's tokens: after each settled verification
    (accepted rows scored, rejected ones not, then evicted down to k at once; under "last" the
    newest accepted row's scores alone) and each plain decode step, the same slots, S and
    tokens as the replay of the accepted rows."""
    k = 12
    window, pooling = options
    prompt, tokens, snaps, after_step = _run(speculative, hf, policy, k, window, pooling)
    snaps.prompt = next((snap for count, snap in after_step if count == 1), None)
    oracle = DenseBudgetOracle(hf, policy, k, 0.3, SEED, MAX_TOKENS, window=window, pooling=pooling)
    logits = oracle.prompt(prompt, follow=snaps.prompt[0] if snaps.prompt else None)
    assert int(logits.argmax()) == tokens[0]
    n = len(prompt)
    settled = iter(snaps.settled)
    verified = rejected = 0
    for start, queries, verifies, accepted in snaps.items:
        if start < n:
            continue
        step = start - n  # index of the fed token among the outputs
        if verifies:
            rows = tokens[step : step + accepted + 1]
            after = next(settled)
            logits = oracle.verify(rows, step, follow=after[0])
            want = tokens[step + 1 : step + accepted + 2]
            assert logits.argmax(-1).tolist()[: len(want)] == want, f"verification at {start}"
            _same_state(after, oracle, f"after verifying at position {start}")
            verified += 1
            rejected += accepted < queries - 1
        else:
            logits = oracle.decode(tokens[step], step)
            if step + 1 < len(tokens):
                assert int(logits.argmax()) == tokens[step + 1]
    assert verified >= 3 and rejected >= 1, "the draft must be both accepted and rejected"
    assert snaps.released is not None
    _same_state(snaps.released, oracle, "at the end")
    assert oracle.ties_followed <= 2, "near-ties are rare; many mean the scores drift"
