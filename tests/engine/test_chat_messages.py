"""Chat messages reach the tokenizer's template the same way from every entry point (LLM.chat,
the OpenAI server's ChatMessage, batch jobs): 'developer' is the system role, no content is "",
and a message's name reaches the template (as vLLM passes it). The oracle is transformers'
apply_chat_template on the messages so normalised."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from keyserve import LLM, SamplingParams
from keyserve.cluster.openai_protocol import ChatMessage

# SmolLM2-style: content concatenated (a missing content is a template error, as there)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}{% if m.name %} {{ m.name }}{% endif %}"
            "{{ '] ' + m['content'] + eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def chat_model(stories_path: str, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("chat_model")
    for f in Path(stories_path).iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return str(out)


@pytest.fixture(scope="module")
def llm(chat_model: str) -> LLM:
    return LLM(chat_model, num_blocks=64, block_size=16)


def _oracle(chat_model: str, messages: list[dict]) -> list[int]:
    out = AutoTokenizer.from_pretrained(chat_model).apply_chat_template(messages, add_generation_prompt=True,
                                                                        tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _chat_ids(llm: LLM, messages: list[dict]) -> list[int]:
    [out] = llm.chat(messages, SamplingParams(max_tokens=1))
    return list(out.prompt_token_ids)


def _server_ids(llm: LLM, messages: list[dict]) -> list[int]:
    return llm.engine.apply_chat_template([ChatMessage(**m).as_template_dict() for m in messages])


@pytest.mark.parametrize("messages, normalised", [
    ([{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
     [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None}, {"role": "user", "content": "b"}],
     [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "b"}]),
    ([{"role": "user", "content": "hi", "name": "alice"}], [{"role": "user", "content": "hi", "name": "alice"}]),
])
def test_llm_chat_and_the_server_give_the_oracle_prompt(llm: LLM, chat_model: str, messages, normalised) -> None:
    want = _oracle(chat_model, normalised)
    assert want.count(llm.engine.tokenizer.bos_token_id) == 1  # the template's BOS, no second one
    assert _chat_ids(llm, messages) == want
    assert _server_ids(llm, messages) == want
