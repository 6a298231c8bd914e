"""Bad input gets a clear error and disturbs nothing else."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from keyserve import LLM, SamplingParams
from keyserve.engine.llm_engine import PromptTooLongError


@pytest.fixture(scope="module")
def llm(stories_path: str) -> LLM:
    return LLM(stories_path, num_blocks=128)


def test_empty_prompt(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        llm.engine.add_request("")
    [spaces] = llm.generate("   ", SamplingParams(max_tokens=2))  # whitespace is text: it has tokens
    assert spaces.prompt_token_ids and len(spaces.outputs[0].token_ids) <= 2


def test_prompt_longer_than_context(llm: LLM) -> None:
    with pytest.raises(PromptTooLongError, match=r"600 tokens.*512"):
        llm.generate([[5] * 600], SamplingParams(max_tokens=4))


def test_unknown_model_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("n", 0), ("max_tokens", 0), ("min_p", 2.0)],
)
def test_invalid_sampling_values_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingParams(**{field: value})
    assert field in str(info.value)


def test_context_longer_than_the_model_supports(stories_path: str) -> None:
    with pytest.raises(ValueError, match="max_model_len=600 exceeds the model's max_position_embeddings=512"):
        LLM(stories_path, num_blocks=8, max_model_len=600)


def test_more_samples_than_seats(stories_path: str) -> None:
    small = LLM(stories_path, num_blocks=32, max_num_seqs=4)
    with pytest.raises(ValueError, match="n=5 exceeds the engine's max_num_seqs=4"):
        small.engine.add_request("once", SamplingParams(n=5))
    assert not small.engine.has_unfinished_requests()


def test_errors_leave_running_requests_untouched(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    good = engine.add_request("once upon a time", params)
    engine.step()
    with pytest.raises(PromptTooLongError):
        engine.add_request([3] * 1000)
    with pytest.raises(ValueError):
        engine.add_request("")
    finished = engine.run_until_done()
    assert set(finished) == {good}
    assert len(finished[good].token_ids) == 8
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_frees_blocks(llm: LLM) -> None:
    engine = llm.engine
    rid = engine.add_request("once upon a time there was", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    out = engine.abort(rid)
    assert out is not None and out.finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_without_cuda_is_a_clear_error(stories_path: str) -> None:
    with pytest.raises(ValueError, match="device 'cuda' was asked for, but this process has"):
        LLM(stories_path, device="cuda", num_blocks=16)


@pytest.mark.timeout(120)  # the bug was a hang
def test_a_request_that_outgrows_the_pool_fails_alone(stories_path: str) -> None:
    """Prompts are checked against the KV pool when added; a request that outgrows it while
    generating (2 blocks of 4 tokens here) cannot be scheduled even alone. It comes back
    finished with an error instead of waiting forever (``generate`` used to spin on empty
    steps), and a request queued behind it, which fits, runs as it would alone (first come,
    first served used to hold it too)."""
    small = LLM(stories_path, num_blocks=2, block_size=4)
    fits = SamplingParams(max_tokens=3, temperature=0.0)
    [alone] = small.generate(["Once"], fits)
    [big] = small.generate(["Once"], SamplingParams(max_tokens=30, ignore_eos=True))
    assert big.finished and big.error is not None and "cannot be scheduled" in str(big.error)
    engine = small.engine
    big_id = engine.add_request("Once", SamplingParams(max_tokens=30, ignore_eos=True))
    while engine.waiting_request_ids() != [big_id]:  # running until preempted for good
        engine.step()
    behind = engine.add_request("Once", fits)
    done = engine.run_until_done()
    assert done[big_id].error is not None and done[behind].error is None
    assert done[behind].outputs[0].token_ids == alone.outputs[0].token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_bad_prompt_later_in_the_list_queues_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError):
        llm.generate([[1, 2, 3], [99999]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2), SamplingParams(stop_token_ids=[100000])])
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("prompts", [None, [None], [1.5], [["a"]], 7])
def test_prompts_of_the_wrong_type_are_named(llm: LLM, prompts) -> None:
    with pytest.raises(ValueError, match="must be text"):
        llm.generate(prompts, SamplingParams(max_tokens=2))


@pytest.mark.parametrize("messages,match", [
    ("Hi", "must be a conversation"), (None, "must be a conversation"), ([], "must be a conversation"),
    (["Hi", "there"], "conversation 0 must be a non-empty list"), ([[]], "conversation 0 must be a non-empty list"),
    ([{"role": "user", "content": 5}], "message 0: 'content' must be a string, not int"),
    ([{"content": "hi"}], "message 0: 'role' must be a string"),
])
def test_chat_messages_are_checked(llm: LLM, messages, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.chat(messages)


def test_request_ids_and_chat_token_ids(llm: LLM) -> None:
    with pytest.raises(ValueError, match="request_id must be a non-empty string"):
        llm.engine.add_request("Once", SamplingParams(max_tokens=2), request_id="")
    with pytest.raises(ValueError, match="chat=True wraps text"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), chat=True)
    assert not llm.engine.requests


@pytest.mark.parametrize("num_blocks", [10**12, 10**15])  # more than memory; more than int64 bytes
def test_a_kv_pool_that_cannot_be_allocated_is_a_clear_error(stories_path: str, num_blocks: int) -> None:
    with pytest.raises(ValueError, match=rf"cannot allocate the KV cache: {num_blocks} blocks of 16 tokens need"):
        LLM(stories_path, num_blocks=num_blocks, block_size=16)


def test_token_ids_of_numpy_ints_and_bytes(llm: LLM) -> None:
    """numpy ints are token ids (as in a notebook's array.tolist()-less list); bytes are not:
    a bytes object is a sequence of ints, and its byte values ran as a prompt of token ids."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    ids = list(llm.tokenizer.encode("Once upon a time"))
    [want] = llm.generate([ids], greedy)
    [got] = llm.generate([[np.int64(t) for t in ids]], greedy)
    assert got.token_ids == want.token_ids and got.prompt_token_ids == ids
    with pytest.raises(ValueError, match="bytes"):
        llm.generate(b"Once upon a time", greedy)
    with pytest.raises(ValueError, match="bytes"):
        llm.generate(["Once", b"upon"], greedy)
    st = llm.engine.stats()
    assert not llm.engine.requests and st.num_free_blocks == st.num_blocks
