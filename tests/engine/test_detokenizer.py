"""The incremental detokenizer against the oracle: the tokenizer's own decode of all the ids."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from keyserve.core.prompt_context import prompt_context
from keyserve.engine.detokenizer import IncrementalDetokenizer
from keyserve.model.paths import DEFAULT_MODEL_NAME, models_dir

# Metaspace + byte fallback (stories260K's Llama tokenizer) is the hard case: partial UTF-8,
# the leading space dropped at the start. The default model's byte-level BPE where converted.
NAMES = ["stories260k"]
if (models_dir() / DEFAULT_MODEL_NAME / "tokenizer.json").exists():
    NAMES.append("smollm2")


@pytest.fixture(scope="module", params=NAMES)
def tokenizer(request, stories_path):
    path = stories_path if request.param == "stories260k" else models_dir() / DEFAULT_MODEL_NAME
    return AutoTokenizer.from_pretrained(path)


def _streams(tokenizer, ids: list[int]) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = [detok.append(t) for t in ids]
    return detok.text, pieces


def test_uses_the_rust_stream(tokenizer):
    assert IncrementalDetokenizer(tokenizer, [])._stream is not None


_ALPHABET = "abcdefghij KLMNOP.,!?'\n\t0123456789éüñßçø中文字日本語한국어🙂🚀∑≈€"


@pytest.mark.parametrize("seed", range(30))
def test_incremental_text_equals_full_decode(tokenizer, seed):
    """Any valid text (multi-byte characters come as byte-fallback tokens, a partial UTF-8
    sequence at a time) streams to exactly the tokenizer's full decode, piece by piece."""
    rng = random.Random(seed)
    sample = "".join(rng.choice(_ALPHABET) for _ in range(rng.randrange(1, 80)))
    ids = tokenizer.encode(sample, add_special_tokens=False)
    if seed % 3 == 0 and tokenizer.all_special_ids:  # special tokens are skipped, as decode does
        ids.insert(rng.randrange(len(ids) + 1), tokenizer.all_special_ids[0])
    text, pieces = _streams(tokenizer, ids)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == text


@pytest.mark.parametrize("seed", range(20))
def test_invalid_bytes_stream_append_only(tokenizer, seed):
    """Random ids (stray bytes that are no UTF-8): never raises, the pieces add up to the text,
    and valid text after them comes through whole."""
    rng = random.Random(seed)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 120))]
    text, pieces = _streams(tokenizer, ids)
    assert "".join(pieces) == text
    tail = tokenizer.encode(" the end", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    for t in ids + tail:
        detok.append(t)
    assert detok.text.endswith("the end")


def test_real_text_roundtrips(tokenizer):
    sentence = "Once upon a time, a little girl named Lily found a shiny red ball."
    ids = tokenizer.encode(sentence, add_special_tokens=False)
    text, pieces = _streams(tokenizer, ids)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert sum(1 for p in pieces if p) > 5  # emitted as it went, not all at the end


def test_stop_string_cuts_the_text(tokenizer):
    ids = tokenizer.encode("Lily saw a big dog. The dog ran.", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, ["dog"])
    for t in ids:
        detok.append(t)
        if detok.stopped_at is not None:
            break
    assert detok.stopped_at is not None
    assert detok.text == "Lily saw a big "


def test_full_decode_fallback_without_a_rust_backend(tokenizer):
    class SlowOnly:  # what a tokenizer without a Rust backend offers
        clean_up_tokenization_spaces = False

        def decode(self, ids, skip_special_tokens):
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer.encode("A cat sat on the mat.", add_special_tokens=False)
    detok = IncrementalDetokenizer(SlowOnly(), [])
    assert detok._stream is None
    for t in ids:
        detok.append(t)
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_flush_gives_the_text_still_held(tokenizer):
    """A trailing U+FFFD the model wrote (a valid character) and a character cut short by the
    last token are held by the stream as if more bytes could follow; at the end of the sample
    ``flush`` gives them, so the text is the tokenizer's full decode."""
    whole = tokenizer.encode("Hi 🙂", add_special_tokens=False)
    for ids in (tokenizer.encode("Hello \ufffd", add_special_tokens=False), whole[:-1]):
        detok = IncrementalDetokenizer(tokenizer, [])
        pieces = [detok.append(t) for t in ids] + [detok.flush()]
        assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(pieces) == detok.text


def test_flushed_text_meets_stop_strings(tokenizer):
    ids = tokenizer.encode("Hello \ufffd", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, ["\ufffd"])
    for t in ids:
        detok.append(t)
    detok.flush()
    assert detok.stopped_at is not None and detok.text == "Hello "


def test_restart_after_rewritten_bytes_keeps_the_next_words_space(stories_path):
    """A byte token that is a character on its own, then a stray byte: the full decode turns
    both into U+FFFD, so the stream cannot go on. The text after it keeps its word-initial
    space, and the stray byte shows as U+FFFD."""
    tok = AutoTokenizer.from_pretrained(stories_path)
    ids = (tok.encode("Hello", add_special_tokens=False) + tok.convert_tokens_to_ids(["<0x41>", "<0xC1>"])
           + tok.encode(" big world", add_special_tokens=False))
    detok = IncrementalDetokenizer(tok, [])
    pieces = [detok.append(t) for t in ids]
    assert "".join(pieces) == detok.text
    assert detok.text.endswith("\ufffd big world")


def test_engine_text_is_the_full_decode_at_the_end(stories_path):
    """Through the engine (teacher forcing makes it emit these tokens): the finished text has
    what the stream still held."""
    from keyserve import LLM, SamplingParams

    llm = LLM(stories_path, num_blocks=64, block_size=16)
    tok = llm.engine.tokenizer
    for ids in (tok.encode("Hello \ufffd", add_special_tokens=False),
                tok.encode("Hi 🙂", add_special_tokens=False)[:-2]):
        rid = llm.engine.add_request("Once upon a time", SamplingParams(max_tokens=1), forced_token_ids=ids)
        out = None
        while out is None:
            out = next((o for o in llm.engine.step() if o.request_id == rid and o.finished), None)
        assert out.token_ids == ids
        assert out.text == _after_prompt(tok, out.prompt_token_ids, ids)


def _after_prompt(tok, prompt_ids: list[int], ids: list[int]) -> str:
    """The oracle for a sample's text: what its tokens add to the prompt's full decode."""
    before = tok.decode(prompt_ids, skip_special_tokens=True)
    full = tok.decode(prompt_ids + ids, skip_special_tokens=True)
    assert full.startswith(before)
    return full[len(before):]


@pytest.mark.parametrize("backend", ["stream", "full decode"])
def test_the_first_word_keeps_its_space_after_the_prompt(stories_path, backend):
    """Decoded after the prompt's last tokens (``prompt_context``, as vLLM primes its
    detokenizer), the first generated word keeps its leading space, which a SentencePiece
    decode of the output alone strips: prompt + text is the text of all the tokens (echo).
    Also after a prompt whose last token is half a character (its context skips that cut)."""
    tok = AutoTokenizer.from_pretrained(stories_path)
    cut = tok.convert_tokens_to_ids(["<0xC3>"])  # the first byte of a two-byte character
    for prompt in (tok.encode("Once", add_special_tokens=False),
                   tok.encode("Once upon a time there was a dog", add_special_tokens=True),
                   tok.encode("The café", add_special_tokens=False) + cut):
        ids = tok.encode(" upon a time, a girl", add_special_tokens=False)
        if backend == "stream":
            detok = IncrementalDetokenizer(tok, [], prompt_context(tok, prompt))
        else:
            class SlowOnly:  # no Rust backend: the full-decode path
                def decode(self, ids, skip_special_tokens):
                    return tok.decode(ids, skip_special_tokens=skip_special_tokens)
            detok = IncrementalDetokenizer(SlowOnly(), [], prompt_context(tok, prompt))
        pieces = [detok.append(t) for t in ids] + [detok.flush()]
        assert "".join(pieces) == detok.text
        assert detok.text == _after_prompt(tok, prompt, ids)
        if prompt[-1] not in cut:
            assert detok.text.startswith(" upon a time")
        assert tok.decode(ids, skip_special_tokens=True).startswith("upon")  # what it replaces
