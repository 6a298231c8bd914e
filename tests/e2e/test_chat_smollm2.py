"""Chat completions on the default model (SmolLM2-135M-Instruct, its chat template), through
the real ``openai`` client. Generations stay short: this is a 2-core CPU."""

from __future__ import annotations

import httpx
import pytest
from live_server import LiveServer, live_server

pytestmark = pytest.mark.slow

SYSTEM = ("You are a helpful assistant who answers in one short sentence. You know a lot about "
          "cats, dogs, birds and fish, and you never use more words than needed.")
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What do cats eat?"}]


@pytest.fixture(scope="module")
def server() -> LiveServer:
    with live_server(model=None, num_blocks=256, max_model_len=1024, max_num_seqs=8, seed=0) as live:
        yield live


def test_chat_completion(server: LiveServer) -> None:
    client = server.client()
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES,
                                         max_completion_tokens=8, temperature=0)
    [choice] = out.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.usage.prompt_tokens > len(SYSTEM.split())  # the template wraps the messages
    assert 0 < out.usage.completion_tokens <= 8


def test_chat_streaming_with_usage(server: LiveServer) -> None:
    client = server.client()
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=8, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_n_and_seed_are_reproducible(server: LiveServer) -> None:
    client = server.client()

    def run(seed: int) -> list[str]:
        out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, n=2,
                                             max_tokens=6, temperature=1.0, seed=seed)
        assert sorted(c.index for c in out.choices) == [0, 1]
        return [c.message.content for c in sorted(out.choices, key=lambda c: c.index)]

    assert run(3) == run(3)


def test_repeated_system_prompt_is_served_from_the_prefix_cache(server: LiveServer) -> None:
    client = server.client()
    other = [MESSAGES[0], {"role": "user", "content": "And dogs?"}]
    client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=1)
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=other, max_tokens=1)
    assert out.usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_logprobs(server: LiveServer) -> None:
    out = server.client().chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES,
                                                  max_tokens=5, temperature=0, logprobs=True)
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens
    assert all(e.logprob <= 0.0 for e in entries)
    assert "".join(e.token for e in entries).strip() == out.choices[0].message.content.strip()


def test_streamed_chat_logprobs_are_the_non_streamed_ones(server: LiveServer) -> None:
    """With a long stop string the text that could start it is held back; the logprobs of its
    tokens go out with the next chunk, none lost."""
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=24, temperature=0,
                  logprobs=True, stop=["xyzxyzxyz"], extra_body={"ignore_eos": True})
    client = server.client()
    full = [(e.token, e.logprob) for e in client.chat.completions.create(**kwargs).choices[0].logprobs.content]
    streamed = [(e.token, e.logprob) for chunk in client.chat.completions.create(**kwargs, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert len(full) == 24 and streamed == full


def test_chat_longer_than_the_context(server: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "cats and dogs " * 600}]}
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages" and err["code"] == "context_length_exceeded"
    assert "1024" in err["message"]
