"""Every error the server can give, over raw HTTP, in the OpenAI envelope; none of them
disturbs the server or the other requests. One server (stories260K) with an API key, a small
bounded queue and a 1 s request timeout."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import httpx
import pytest
from live_server import LiveServer, live_server

KEY = "sk-keyserve-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_NUM_SEQS, MAX_QUEUED = 4, 4


@pytest.fixture(scope="module")
def server(stories_path: str) -> LiveServer:
    with live_server(model=stories_path, num_blocks=2048, api_key=KEY, max_num_seqs=MAX_NUM_SEQS,
                     max_queued_requests=MAX_QUEUED, request_timeout_s=1.0, retry_after_s=2) as live:
        yield live


def post(server: LiveServer, path: str, body=None, *, content: bytes | None = None, headers=AUTH):
    return httpx.post(server.base_url + path, json=body if content is None else None, content=content,
                      headers={"content-type": "application/json", **(headers or {})}, timeout=60)


def envelope(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"]
    return err


def test_malformed_json(server: LiveServer) -> None:
    err = envelope(post(server, "/completions", content=b'{"prompt": "x",'), 400)
    assert err["code"] == "invalid_json" and err["type"] == "invalid_request_error"
    envelope(post(server, "/completions", content=b"[1, 2]"), 400)
    envelope(post(server, "/chat/completions", content=b"\xff\xfe"), 400)


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("n", 0), ("max_tokens", 0),
    ("max_tokens", "ten"), ("min_p", 2.0), ("top_k", -1), ("seed", -3), ("stop", [""]),
    ("kv_policy", "bogus"), ("kv_budget", -1.0), ("kv_budget", 2.5), ("recent_ratio", 2.0),
    ("num_speculative_tokens", 0), ("logprobs", 50), ("presence_penalty", 0.5),
    ("logit_bias", {"1": 5}), ("suffix", "x"), ("kv_polcy", "h2o"),
])
def test_bad_completion_field_names_it(server: LiveServer, field: str, value) -> None:
    err = envelope(post(server, "/completions", {"prompt": "Once", field: value}), 400)
    assert err["param"] == field, err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("field,value", [
    ("messages", []), ("max_completion_tokens", 0), ("top_logprobs", 3), ("temperature", "hot"),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("messages", [{"role": "wizard", "content": "hi"}]),
])
def test_bad_chat_field_names_it(server: LiveServer, field: str, value) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], field: value}
    err = envelope(post(server, "/chat/completions", body), 400)
    assert err["param"] == field, err


def test_missing_prompt(server: LiveServer) -> None:
    assert envelope(post(server, "/completions", {"max_tokens": 3}), 400)["param"] == "prompt"
    assert envelope(post(server, "/completions", {"prompt": []}), 400)["param"] == "prompt"
    assert envelope(post(server, "/completions", {"prompt": ""}), 400)["param"] == "prompt"
    assert envelope(post(server, "/completions", {"prompt": ["hi", ""]}), 400)["param"] == "prompt"


def test_whitespace_is_a_prompt(server: LiveServer) -> None:
    """Spaces and newlines are text with tokens, as in OpenAI's API and vLLM."""
    for prompt in (" ", "\n", ["hi", "  "]):
        r = post(server, "/completions", {"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] >= 1


def test_stream_options_need_a_stream(server: LiveServer) -> None:
    body = {"prompt": "Once", "max_tokens": 2, "stream_options": {"include_usage": True}}
    assert envelope(post(server, "/completions", body), 400)["param"] == "stream_options"
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}
    assert envelope(post(server, "/chat/completions", chat), 400)["param"] == "stream_options"


def test_health_answers_head(server: LiveServer) -> None:
    assert httpx.head(server.url + "/health").status_code == 200


def test_prompt_longer_than_the_context_states_both_lengths(server: LiveServer) -> None:
    err = envelope(post(server, "/completions", {"prompt": [5] * 600}), 400)
    assert "600" in err["message"] and "512" in err["message"]
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    text = "Once upon a time " * 200
    err = envelope(post(server, "/completions", {"prompt": text}), 400)
    assert "512" in err["message"] and err["code"] == "context_length_exceeded"


def test_token_ids_outside_the_vocabulary(server: LiveServer) -> None:
    err = envelope(post(server, "/completions", {"prompt": [1, 2, 100000]}), 400)
    assert err["param"] == "prompt" and "512" in err["message"]


def test_more_samples_than_seats_names_n(server: LiveServer) -> None:
    err = envelope(post(server, "/completions", {"prompt": "Once", "n": MAX_NUM_SEQS + 1}), 400)
    assert err["param"] == "n" and "max_num_seqs" in err["message"]


def test_speculative_without_a_draft(server: LiveServer) -> None:
    err = envelope(post(server, "/completions", {"prompt": "Once", "speculative": True}), 400)
    assert err["param"] == "speculative"


def test_chat_on_a_model_without_chat_template(server: LiveServer) -> None:
    err = envelope(post(server, "/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}), 400)
    assert err["param"] == "messages" and "chat template" in err["message"]


def test_a_chat_template_that_refuses_the_messages_is_400(server: LiveServer) -> None:
    """Many real templates check the conversation themselves (Llama 2 and Mistral raise "roles
    must alternate"): that is the client's input, not a server error."""
    tokenizer = server.serving.engine.engine.tokenizer
    tokenizer.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}")
    try:
        twice = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}],
                 "max_tokens": 2}
        for stream in (False, True):
            err = envelope(post(server, "/chat/completions", {**twice, "stream": stream}), 400)
            assert err["param"] == "messages" and "roles must alternate" in err["message"]
        ok = post(server, "/chat/completions", {"messages": twice["messages"][:1], "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    finally:
        tokenizer.chat_template = None
    assert server.metrics().get("keyserve:request_rejected_total{500}", 0) == 0


def test_unknown_model_is_404(server: LiveServer) -> None:
    for path, body in (("/completions", {"prompt": "x"}),
                       ("/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        err = envelope(post(server, path, {"model": "gpt-17", **body}), 404)
        assert err["param"] == "model" and err["code"] == "model_not_found"


def test_api_key(server: LiveServer) -> None:
    body = {"prompt": "Once", "max_tokens": 2}
    assert envelope(post(server, "/completions", body, headers={}), 401)["code"] == "invalid_api_key"
    envelope(post(server, "/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    envelope(post(server, "/completions", body, headers={"Authorization": f"Basic {KEY}"}), 401)
    envelope(httpx.get(server.base_url + "/models"), 401)
    assert httpx.get(server.base_url + "/models", headers=AUTH).status_code == 200
    assert post(server, "/completions", body).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200  # open without a key
    assert httpx.get(server.url + "/metrics").status_code == 200
    out = server.client(api_key=KEY).completions.create(model=server.serving.model_name, prompt="Once",
                                                         max_tokens=2)
    assert out.choices[0].text


def test_unknown_route_and_method(server: LiveServer) -> None:
    envelope(httpx.get(server.url + "/v2/nothing", headers=AUTH), 404)
    envelope(httpx.get(server.base_url + "/completions", headers=AUTH), 405)


def test_full_queue_is_503_with_retry_after(server: LiveServer) -> None:
    server.wait_idle()
    body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(headers=AUTH, timeout=60) as client:
            return await asyncio.gather(*(client.post(server.base_url + "/completions", json=body)
                                          for _ in range(16)))

    responses = asyncio.run(main())
    full = [r for r in responses if r.status_code == 503]
    assert full, [r.status_code for r in responses]
    assert len(responses) - len(full) <= MAX_NUM_SEQS + MAX_QUEUED + 2  # admitted: bounded
    for r in full:
        assert envelope(r, 503)["type"] == "server_error"
        assert r.headers["Retry-After"] == "2"
    assert {r.status_code for r in responses} <= {200, 408, 503}
    server.wait_idle()
    assert server.metrics()["keyserve:request_rejected_total{503}"] >= len(full)
    assert post(server, "/completions", {"prompt": "Once", "max_tokens": 3}).status_code == 200


@contextlib.contextmanager
def slow_steps(server: LiveServer, seconds: float = 0.005) -> Iterator[None]:
    """Every model forward of the server's engine takes at least ``seconds`` more: a request of
    500 steps then outlives the 1 s deadline on any machine (stories260K decodes 4 x 500 tokens
    in well under a second on a fast CPU, so without this the timeout tests depend on the
    machine's speed). The only fault injected: the deadline, abort and error paths are real."""
    model = server.serving.engine.engine.runner.model
    forward = model.forward

    def slow(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        time.sleep(seconds)
        return forward(*args, **kwargs)

    model.forward = slow
    try:
        yield
    finally:
        del model.forward  # back to the class's method


def test_request_timeout_is_408_and_aborts(server: LiveServer) -> None:
    server.wait_idle()
    body = {"prompt": "Once upon a time", "max_tokens": 500, "n": MAX_NUM_SEQS, "ignore_eos": True}
    with slow_steps(server):
        err = envelope(post(server, "/completions", body), 408)
    assert err["code"] == "request_timeout" and err["type"] == "timeout_error"
    server.wait_idle(timeout=10)  # aborted: its KV blocks are back


def test_timeout_while_streaming_ends_the_stream_with_an_error_event(server: LiveServer) -> None:
    server.wait_idle()
    body = {"prompt": "Once upon a time", "max_tokens": 500, "n": MAX_NUM_SEQS, "ignore_eos": True, "stream": True}
    with slow_steps(server), httpx.stream("POST", server.base_url + "/completions", json=body, headers=AUTH,
                                          timeout=60) as r:
        assert r.status_code == 200  # the first tokens came before the deadline
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert '"request_timeout"' in events[-2] and '"error"' in events[-2]
    server.wait_idle(timeout=10)


def test_timeout_while_streaming_counts_as_a_408(server: LiveServer) -> None:
    """The status is already 200 when the deadline hits mid-stream; the error event's 408
    still counts in request_rejected_total, as the non-streamed 408 does."""
    server.wait_idle()
    before = server.metrics().get("keyserve:request_rejected_total{408}", 0.0)
    body = {"prompt": "Once upon a time", "max_tokens": 500, "n": MAX_NUM_SEQS, "ignore_eos": True, "stream": True}
    with slow_steps(server), httpx.stream("POST", server.base_url + "/completions", json=body, headers=AUTH,
                                          timeout=60) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert '"request_timeout"' in events[-2]
    server.wait_idle(timeout=10)
    assert server.metrics().get("keyserve:request_rejected_total{408}", 0.0) == before + 1


def test_a_timeout_of_several_prompts_is_408_too(server: LiveServer) -> None:
    """Several prompts in one request are several engine requests merged into one response:
    their timeout is the same 408 (not a 500 from closing a stream a pump was still reading),
    streamed or not, and nothing is logged as an unexpected error."""
    server.wait_idle()
    body = {"prompt": ["Once upon a time", "Tim"], "max_tokens": 500, "ignore_eos": True}
    errors_before = server.metrics().get("keyserve:request_rejected_total{500}", 0)
    with slow_steps(server):
        err = envelope(post(server, "/completions", body), 408)
        assert err["code"] == "request_timeout"
        with httpx.stream("POST", server.base_url + "/completions", json={**body, "stream": True},
                          headers=AUTH, timeout=60) as r:
            events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and '"request_timeout"' in events[-2]
    assert server.metrics().get("keyserve:request_rejected_total{500}", 0) == errors_before
    server.wait_idle(timeout=10)


def test_errors_do_not_disturb_other_requests(server: LiveServer) -> None:
    server.wait_idle()
    good = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    bad = [{"prompt": [5] * 600}, {"prompt": "x", "top_p": 7}, {"prompt": [100000]},
           {"prompt": "x", "model": "nope"}]

    async def main():
        async with httpx.AsyncClient(headers=AUTH, timeout=60) as client:
            url = server.base_url + "/completions"
            return await asyncio.gather(client.post(url, json=good),
                                        *(client.post(url, json=b) for b in bad * 3),
                                        client.post(url, content=b"{nope"))

    alone = post(server, "/completions", good).json()["choices"][0]["text"]
    first, *rest = asyncio.run(main())
    assert first.status_code == 200 and first.json()["choices"][0]["text"] == alone
    assert all(r.status_code in (400, 404) for r in rest)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    server.wait_idle()
