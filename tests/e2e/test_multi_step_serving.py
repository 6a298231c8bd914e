"""Multi-step scheduling behind the OpenAI server (``--num-scheduler-steps 4``), through the
official client: completions and chat, plain and streamed, answer what the server with one step
per round answers -- text, log-probabilities, finish reasons, usage -- while a stream's chunks
carry the rounds' tokens. Two live servers on stories260K, one after the other."""

from __future__ import annotations

import pytest
from live_server import live_server

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
PROMPTS = ["Once upon a time there was a little dog named Max", "Lily went to the park and"]


def _answers(stories_path: str, steps: int) -> dict:
    """Every answer of one server, and the token counts of its streamed chunks."""
    with live_server(model=stories_path, num_blocks=512, seed=0, num_scheduler_steps=steps) as live:
        live.engine.tokenizer.chat_template = TEMPLATE  # stories260K has none
        client = live.client()
        out: dict = {}
        for i, prompt in enumerate(PROMPTS):
            r = client.completions.create(model=live.serving.model_name, prompt=prompt, max_tokens=30, n=2,
                                          temperature=0.9, seed=7 + i, logprobs=0, stop=[" park."])
            out[f"completion {i}"] = [(c.text, c.finish_reason, c.logprobs.token_logprobs) for c in r.choices]
            out[f"usage {i}"] = (r.usage.prompt_tokens, r.usage.completion_tokens)
            chunks = list(client.completions.create(model=live.serving.model_name, prompt=prompt, max_tokens=25,
                                                    temperature=0, stream=True, logprobs=0,
                                                    stream_options={"include_usage": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            sizes = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs]
            out[f"stream {i}"] = (text, chunks[-1].usage.completion_tokens)
            out[f"chunk sizes {i}"] = sizes
            chat = client.chat.completions.create(model=live.serving.model_name, max_tokens=20, temperature=0,
                                                  messages=[{"role": "user", "content": prompt}], logprobs=True)
            out[f"chat {i}"] = (chat.choices[0].message.content, chat.choices[0].finish_reason,
                                [t.logprob for t in chat.choices[0].logprobs.content])
        live.wait_idle()
        out["engine steps"] = live.engine.engine.num_steps
        return out


@pytest.fixture(scope="module")
def single(stories_path: str) -> dict:
    return _answers(stories_path, 1)


def test_answers_equal_one_step_per_round_and_chunks_carry_rounds(stories_path: str, single: dict) -> None:
    rounds = _answers(stories_path, 4)
    assert rounds.pop("engine steps") < 0.5 * single["engine steps"]  # rounds of up to 4 steps ran
    for key, want in single.items():
        if key == "engine steps":
            continue
        if key.startswith("chunk sizes"):  # (the front also joins what piled up while a client read)
            assert sum(rounds[key]) == sum(want)
            continue
        if key.startswith(("completion", "chat")):
            for a, b in zip(want if key.startswith("completion") else [want],
                            rounds[key] if key.startswith("completion") else [rounds[key]], strict=True):
                assert b[:2] == a[:2], key
                assert b[2] == pytest.approx(a[2], abs=1e-5), key
            continue
        assert rounds[key] == want, key
