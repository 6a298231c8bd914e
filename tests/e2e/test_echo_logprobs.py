"""Completions' ``echo`` with ``logprobs``: the prompt's tokens come first in ``logprobs`` --
text, offset, log-probability (null for the first token, which has no context) and
alternatives -- then the generated ones, as OpenAI's API gives them and lm-eval's
``local-completions`` loglikelihood reads them (token ids as the prompt, ``max_tokens=1``,
``echo``, ``logprobs=1``, the continuation's entries from ``ctxlen`` on); and vLLM's
``prompt_logprobs`` field (token id -> logprob, rank, decoded text). Through the real
``openai`` client against a live server (stories260K); the oracle is transformers' log-softmax
over the prompt on the same weights."""

from __future__ import annotations

import pytest
import torch
from live_server import LiveServer, live_server

CONTEXT = "Once upon a time there was a little dog named Max."
CONTINUATION = " Max liked to run in the park with his friends."


@pytest.fixture(scope="module")
def server(stories_path: str) -> LiveServer:
    with live_server(model=stories_path, num_blocks=256, seed=0, max_num_batched_tokens=16) as live:
        tok = live.engine.tokenizer
        tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # stories260K has none
        yield live
        tok.chat_template = None


@pytest.fixture(scope="module")
def hf_logprobs(stories_hf):
    hf = stories_hf

    def logprobs(ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]: row i predicts token i + 1
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


@pytest.mark.parametrize("stream", [False, True])
def test_lm_eval_loglikelihood_request(server: LiveServer, hf_logprobs, stream: bool) -> None:
    tok = server.engine.tokenizer
    ctx = tok.encode(CONTEXT)
    ids = ctx + tok.encode(CONTINUATION, add_special_tokens=False)
    client = server.client()
    kw = dict(model=server.serving.model_name, prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0)
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        lp_parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for p in lp_parts for t in p.tokens]
        values = [v for p in lp_parts for v in p.token_logprobs]
        tops = [t for p in lp_parts for t in p.top_logprobs]
        offsets = [o for p in lp_parts for o in p.text_offset]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    else:
        choice = client.completions.create(**kw).choices[0]
        tokens, values = choice.logprobs.tokens, choice.logprobs.token_logprobs
        tops, offsets, text = choice.logprobs.top_logprobs, choice.logprobs.text_offset, choice.text
    assert len(tokens) == len(values) == len(tops) == len(offsets) == len(ids) + 1
    assert values[0] is None and tops[0] is None
    want = hf_logprobs(ids)
    oracle = want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(torch.tensor(values[1 : len(ids)]), oracle, atol=1e-4, rtol=0)
    # what lm-eval computes: the continuation's summed logprob and whether it is greedy
    ctxlen = len(ctx)
    continuation = values[ctxlen:-1]
    assert sum(continuation) == pytest.approx(float(oracle[ctxlen - 1 :].sum()), abs=1e-3)
    greedy = [max(top.values()) == v for top, v in zip(tops[ctxlen:-1], continuation)]
    assert greedy == (want[ctxlen - 1 : -1].argmax(-1) == torch.tensor(ids[ctxlen:])).tolist()
    # the echoed prompt's pieces spell the echo, their offsets point into the text
    assert text.startswith("".join(tokens[: len(ids)]))
    assert offsets == sorted(offsets) and all(text[o : o + len(t)] == t for o, t in zip(offsets, tokens))


def test_text_prompt_with_alternatives(server: LiveServer, hf_logprobs) -> None:
    """A text prompt, ``logprobs=3``, two samples: each choice carries the prompt's entries
    (alternatives included) before its own tokens'."""
    client = server.client()
    out = client.completions.create(model=server.serving.model_name, prompt=CONTEXT, max_tokens=3, echo=True,
                                    logprobs=3, n=2, temperature=0.9, seed=1)
    ids = server.engine.tokenizer.encode(CONTEXT)
    want = hf_logprobs(ids)
    for choice in out.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for pos in range(1, len(ids)):
            top = lp.top_logprobs[pos]
            assert 3 <= len(top) <= 4 and top[lp.tokens[pos]] == pytest.approx(lp.token_logprobs[pos], abs=1e-6)
            assert sorted(top.values(), reverse=True)[:3] == pytest.approx(
                want[pos - 1].topk(3).values.tolist(), abs=1e-4)
        assert choice.text.startswith(CONTEXT)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_vllm_prompt_logprobs_field(server: LiveServer, hf_logprobs, endpoint: str) -> None:
    """vLLM's ``prompt_logprobs`` (through the client's ``extra_body``): per prompt token after
    the first, token id -> {logprob, rank, decoded_token} for the token and its N likeliest
    alternatives (ranks 1..N); on each choice for completions, on the response for chat. With
    stream it is a 400 naming the field, as in vLLM."""
    client = server.client()
    model = server.serving.model_name
    if endpoint == "completions":
        raw = client.completions.with_raw_response.create(model=model, prompt=CONTEXT, max_tokens=2, temperature=0,
                                                          extra_body={"prompt_logprobs": 2})
        body = raw.http_response.json()
        entries = body["choices"][0]["prompt_logprobs"]
        ids = server.engine.tokenizer.encode(CONTEXT)
    else:
        messages = [{"role": "user", "content": "Tell me a story."}]
        raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=2,
                                                               temperature=0, extra_body={"prompt_logprobs": 2})
        body = raw.http_response.json()
        entries = body["prompt_logprobs"]
        encoded = server.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
        assert body["usage"]["prompt_tokens"] == len(ids)
    want = hf_logprobs(ids)
    assert len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        entry, row = entries[pos], want[pos - 1]
        own = entry[str(ids[pos])]
        assert own["logprob"] == pytest.approx(float(row[ids[pos]]), abs=1e-4)
        value = row[ids[pos]]  # its rank, up to tokens within 1e-4 of it (float rounding decides those)
        assert int((row > value + 1e-4).sum()) + 1 <= own["rank"] <= int((row > value - 1e-4).sum()) + 1
        alternatives = sorted((e for t, e in entry.items() if e["rank"] <= 2), key=lambda e: e["rank"])
        assert [e["rank"] for e in alternatives] == [1, 2]
        assert [e["logprob"] for e in alternatives] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)
        assert len(entry) in (2, 3) and all(isinstance(e["decoded_token"], str) for e in entry.values())
    import httpx
    r = httpx.post(server.base_url + "/completions", json={"model": model, "prompt": CONTEXT, "stream": True,
                                                           "prompt_logprobs": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_echo_and_prompt_logprobs_each_keep_their_own_count(server: LiveServer) -> None:
    """``echo`` with ``logprobs=1`` beside ``prompt_logprobs=3``: the engine computes 3
    alternatives once; the echoed entries show 1 (plus the token's own), vLLM's field 3."""
    client = server.client()
    raw = client.completions.with_raw_response.create(
        model=server.serving.model_name, prompt=CONTEXT, max_tokens=1, echo=True, logprobs=1, temperature=0,
        extra_body={"prompt_logprobs": 3})
    choice = raw.http_response.json()["choices"][0]
    echoed = choice["logprobs"]["top_logprobs"][1 : -1]
    assert echoed and all(1 <= len(top) <= 2 for top in echoed)
    assert all(3 <= len(entry) <= 4 for entry in choice["prompt_logprobs"][1:])
