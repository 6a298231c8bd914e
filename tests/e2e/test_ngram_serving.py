"""Speculation without a draft model through the server: ``draft="ngram"`` (prompt lookup
alone) on stories260K, exercised by the real ``openai`` client over HTTP."""

from __future__ import annotations

import pytest
from live_server import LiveServer, live_server

PROMPT = "the cat sat on the mat . the cat sat on the mat . the cat sat on the"


@pytest.fixture(scope="module")
def server(stories_path: str) -> LiveServer:
    with live_server(model=stories_path, draft="ngram", num_speculative_tokens=3, seed=0) as live:
        yield live


def test_copied_drafts_are_counted_and_greedy_output_is_unchanged(server: LiveServer) -> None:
    client = server.client()
    model = server.serving.model_name
    before = server.metrics()
    spec = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True, "speculative": False})
    assert spec.choices[0].text == plain.choices[0].text
    after = server.metrics()

    def grew(name: str) -> float:
        return after[f"keyserve:{name}_total"] - before[f"keyserve:{name}_total"]

    assert grew("spec_decode_num_lookup_draft_tokens") == grew("spec_decode_num_draft_tokens") > 0
    assert grew("spec_decode_num_lookup_accepted_tokens") == grew("spec_decode_num_accepted_tokens") > 0


def test_sampled_requests_and_bad_k_stay_clean(server: LiveServer) -> None:
    """A sampled request drafts copies too (p = 1 rows); an out-of-range K is a 400 and the
    server keeps serving."""
    import openai

    client = server.client()
    model = server.serving.model_name
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0.8, seed=3,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4,
                                  extra_body={"num_speculative_tokens": 99})
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert again.usage.completion_tokens >= 1
