"""Every request field takes effect or is refused (a 400 naming it), never silently dropped
(found by an oracle sweep of the OpenAI fields against the server): completions' ``logprobs``
above 0 and chat's ``top_logprobs`` (alternatives: now computed, checked against the engine's),
``stream_options.continuous_usage_stats``
(usage in every chunk: now sent), and a ``kv_policy`` or ``kv_budget`` whose other half neither the
request nor the server gives (the request ran on the full cache). One server (stories260K)."""

from __future__ import annotations

import json

import httpx
import pytest
from live_server import LiveServer, live_server

from keyserve.core.sampling_params import SamplingParams
from keyserve.engine.errors import InvalidParamError

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
PROMPT = "Once upon a time there was a little dog named Max. Max liked to run in the park"


@pytest.fixture(scope="module")
def server(stories_path: str) -> LiveServer:
    with live_server(model=stories_path, num_blocks=512, seed=0) as live:
        tok = live.engine.tokenizer
        tok.chat_template = TEMPLATE  # stories260K has none: let chat requests reach the engine
        yield live
        tok.chat_template = None


def post(server: LiveServer, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + "/completions", json={"prompt": PROMPT, "max_tokens": 4, **body},
                      timeout=60)


def refused(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


def _oracle_tops(server: LiveServer, text: str, count: int, k: int = 3) -> list[list[float]]:
    """The engine's own alternatives for a greedy run of ``text`` (checked against transformers
    in tests/engine/test_top_logprobs.py): their logprobs per token."""
    from keyserve import LLM

    llm = getattr(server, "_oracle_llm", None) or LLM(server.serving.config.model, num_blocks=64)
    server._oracle_llm = llm  # type: ignore[attr-defined]
    [out] = llm.generate(text, SamplingParams(max_tokens=count, temperature=0.0, logprobs=True, top_logprobs=k))
    return [[v for _, v in top] for top in out.outputs[0].top_logprobs]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_logprobs_n_returns_the_models_alternatives(server: LiveServer, stream: bool) -> None:
    """``logprobs=3``: per token the 3 likeliest alternatives (text -> logprob) plus the chosen
    token (up to 4 entries; greedy: the chosen one is the likeliest, so 3), the values the
    engine computes. ``logprobs=0``: the chosen tokens' only."""
    r = post(server, {"logprobs": 3, "temperature": 0, "max_tokens": 6, "stream": stream})
    if stream:
        events = _events(r)
        tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
        lps = [v for e in events for v in e["choices"][0]["logprobs"]["token_logprobs"]]
        tops = [t for e in events for t in e["choices"][0]["logprobs"]["top_logprobs"]]
    else:
        assert r.status_code == 200, r.text
        logprobs = r.json()["choices"][0]["logprobs"]
        tokens, lps, tops = logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]
    want = _oracle_tops(server, PROMPT, 6)
    assert len(tops) == len(tokens) == 6
    for token, lp, top, values in zip(tokens, lps, tops, want):
        assert len(top) == 3 and next(iter(top)) == token and top[token] == pytest.approx(lp, abs=1e-6)
        assert list(top.values()) == pytest.approx(values, abs=1e-5)
    ok = post(server, {"logprobs": 0, "temperature": 0})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"][0]["logprobs"]["token_logprobs"]) == 4
    assert ok.json()["choices"][0]["logprobs"]["top_logprobs"] is None


def test_chat_top_logprobs_returns_the_models_alternatives(server: LiveServer) -> None:
    """Chat's ``top_logprobs=3`` (with ``logprobs``): 3 alternatives per content token, each
    with its text, logprob and bytes; without ``logprobs`` a 400 naming ``top_logprobs``."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "temperature": 0}
    r = httpx.post(server.base_url + "/chat/completions", json={**body, "logprobs": True, "top_logprobs": 3},
                   timeout=60)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        top = entry["top_logprobs"]
        assert len(top) == 3 and top[0]["token"] == entry["token"] and top[0]["logprob"] == entry["logprob"]
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert all(t["bytes"] == list(t["token"].encode()) for t in top)
    refused(httpx.post(server.base_url + "/chat/completions", json={**body, "top_logprobs": 3}, timeout=60),
            "top_logprobs")


def _events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text[:300]
    lines = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(server: LiveServer, kind: str) -> None:
    """vLLM's ``continuous_usage_stats`` (with ``include_usage``): every chunk carries the usage
    so far -- completion tokens never fall and end at the final usage chunk's. Without
    ``include_usage`` no chunk has a usage (as in vLLM); without the option only the last."""
    url = server.base_url + ("/completions" if kind == "completions" else "/chat/completions")
    body = {"prompt": PROMPT} if kind == "completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    body |= {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True, "n": 2}

    def stream(**opts) -> list[dict]:
        return _events(httpx.post(url, json={**body, "stream_options": opts}, timeout=60))

    events = stream(include_usage=True, continuous_usage_stats=True)
    usages = [e["usage"] for e in events]
    assert all(u is not None for u in usages), usages
    assert events[-1]["choices"] == []  # the final usage chunk
    final = usages[-1]
    assert final["completion_tokens"] == 2 * 12 and final["total_tokens"] == final["prompt_tokens"] + 24
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[0] < final["completion_tokens"]
    assert all(u["prompt_tokens"] == final["prompt_tokens"] for u in usages)
    assert all(e.get("usage") is None for e in stream(include_usage=False, continuous_usage_stats=True))
    plain = stream(include_usage=True)
    assert all(e["usage"] is None for e in plain[:-1])
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (this run hits the prefix cache)
    assert [plain[-1]["usage"][k] for k in counts] == [final[k] for k in counts]


def greedy(server: LiveServer, **extra) -> httpx.Response:
    return post(server, {"max_tokens": 30, "temperature": 0, **extra})


def test_a_kv_policy_without_any_budget_is_refused(server: LiveServer) -> None:
    """With no ``kv_budget`` in the request and no server default, a named policy evicted
    nothing: the output was the full cache's. Refused naming ``kv_policy``, on HTTP and from
    Python (admission); with a budget the policy takes effect (the output changes)."""
    full = greedy(server).json()["choices"][0]["text"]
    for policy in ("window", "streaming_llm", "h2o", "keyformer"):
        refused(greedy(server, kv_policy=policy), "kv_policy")
    assert greedy(server, kv_policy="h2o", kv_budget=4).json()["choices"][0]["text"] != full
    assert greedy(server, kv_policy="full").json()["choices"][0]["text"] == full
    with pytest.raises(InvalidParamError) as info:
        server.engine.engine.add_request(PROMPT, SamplingParams(max_tokens=4, kv_policy="h2o"))
    assert info.value.param == "kv_policy"


def test_a_kv_budget_without_a_policy_is_refused(server: LiveServer) -> None:
    """Under the server's default policy ``full`` a ``kv_budget`` with no ``kv_policy`` evicted
    nothing; refused naming ``kv_budget``. An explicit ``kv_policy: full`` with a budget says
    "no eviction" and is accepted."""
    full = greedy(server).json()["choices"][0]["text"]
    refused(greedy(server, kv_budget=4), "kv_budget")
    refused(greedy(server, kv_budget=0.5, stream=True), "kv_budget")
    assert greedy(server, kv_policy="full", kv_budget=4).json()["choices"][0]["text"] == full
    with pytest.raises(InvalidParamError) as info:
        server.engine.engine.add_request(PROMPT, SamplingParams(max_tokens=4, kv_budget=0.5))
    assert info.value.param == "kv_budget"


@pytest.mark.parametrize("stream", [False, True])
def test_completion_text_is_what_its_tokens_add_to_the_prompt(server: LiveServer, stories_path: str,
                                                              stream: bool) -> None:
    """The text is decoded after the prompt's last tokens, as vLLM does: with a SentencePiece
    vocabulary (stories260K) a decode of the output alone strips the first word's space, so
    ``echo`` gave "...parkand" where the tokens say "...park and". Oracle: the tokenizer's
    decode of prompt + output tokens (the greedy tokens, from the Python ``LLM``), minus the
    prompt's."""
    from keyserve import LLM
    from keyserve.core.sampling_params import SamplingParams as Params

    tok = server.engine.tokenizer
    [out] = LLM(stories_path, num_blocks=64).generate(PROMPT, Params(max_tokens=12, temperature=0, ignore_eos=True))
    prompt_ids, ids = out.prompt_token_ids, out.token_ids
    before = tok.decode(prompt_ids, skip_special_tokens=True)
    want = tok.decode(prompt_ids + ids, skip_special_tokens=True)[len(before):]
    assert want[0] == " " and not tok.decode(ids, skip_special_tokens=True).startswith(" ")  # the case
    r = post(server, {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "echo": True, "stream": stream})
    if stream:
        text = "".join(e["choices"][0]["text"] for e in _events(r))
    else:
        text = r.json()["choices"][0]["text"]
    assert text == PROMPT + want
