"""A token's bytes for chat logprobs (``cluster/token_bytes.py``): the bytes of every output
token, concatenated, are the UTF-8 of the text -- also where a character is split over tokens,
whose decoded pieces are U+FFFD (their bytes came out as U+FFFD's own: found by a sweep)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from keyserve.cluster.token_bytes import TokenBytes
from keyserve.model.paths import DEFAULT_MODEL_NAME, models_dir

TEXT = "Hi こむ 🙂 naïve"


NAMES = ["stories260k"] + (["smollm2"] if (models_dir() / DEFAULT_MODEL_NAME / "tokenizer.json").exists() else [])


@pytest.fixture(scope="module", params=NAMES)
def tokenizer(request, stories_path: str):
    path = stories_path if request.param == "stories260k" else models_dir() / DEFAULT_MODEL_NAME
    return AutoTokenizer.from_pretrained(path)


def test_bytes_of_the_tokens_rebuild_the_text(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces)  # some token holds part of a character
    tb = TokenBytes(tokenizer)
    raw = b"".join(bytes(tb.of(t, p)) for t, p in zip(ids, pieces))
    assert raw.decode().lstrip() == tokenizer.decode(ids, skip_special_tokens=True).lstrip()


def test_a_special_token_has_no_bytes(tokenizer) -> None:
    assert TokenBytes(tokenizer).of(tokenizer.eos_token_id, "") == []
