"""Completions logprobs against the text: each token's ``text_offset`` points at it (the text
decoded after the prompt's last tokens, as the engine's detokenizer decodes it)."""

from __future__ import annotations

import pytest

from keyserve.core.prompt_context import prompt_context
from keyserve.engine.detokenizer import IncrementalDetokenizer

from live_server import LiveServer, live_server


@pytest.fixture(scope="module")
def server(stories_server_options: dict):
    with live_server(**stories_server_options) as s:
        yield s


def test_text_offsets_skip_special_tokens(server: LiveServer) -> None:
    """A special token in the output (``ignore_eos``, a sampled BOS) adds nothing to the text,
    so it must not move the offsets of the tokens after it."""
    tok = server.engine.tokenizer
    ids = tok.encode("Lily saw a dog", add_special_tokens=False)
    ids = ids[:2] + [tok.eos_token_id, tok.bos_token_id] + ids[2:]
    prompt = tok.encode("Once upon a time", add_special_tokens=True)
    detok = IncrementalDetokenizer(tok, [], prompt_context(tok, prompt))
    for t in ids:
        detok.append(t)
    assert detok.text.startswith(" Lily")  # after the prompt, its first word keeps its space
    lp = server.serving._completion_logprobs(prompt, ids, 0, [0.0] * len(ids), 0)
    assert "".join(lp.tokens) == detok.text
    for token, offset in zip(lp.tokens, lp.text_offset):
        assert detok.text[offset:offset + len(token)] == token


def test_chat_logprob_bytes_rebuild_a_split_character(server: LiveServer) -> None:
    """Chat logprobs' ``bytes``: a token holding part of a character (stories260K spells
    "こ" as three byte-fallback tokens) has its own byte, not U+FFFD's; all of them, joined,
    are the text's UTF-8."""
    tok = server.engine.tokenizer
    ids = tok.encode("Lily said こむ 🙂", add_special_tokens=False)
    prompt = tok.encode("Once upon a time", add_special_tokens=True)
    detok = IncrementalDetokenizer(tok, [], prompt_context(tok, prompt))
    for t in ids:
        detok.append(t)
    detok.flush()
    entries = server.serving._chat_logprobs(prompt, ids, 0, [0.0] * len(ids)).content
    assert any(e.token == "\ufffd" for e in entries)  # the split character's pieces
    assert b"".join(bytes(e.bytes) for e in entries).decode() == detok.text
