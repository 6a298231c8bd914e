"""Which prompt tokens a sample's text is decoded after (the detokenizer's context, and the
server's per-token strings): one choice, so the text and its logprob offsets agree."""

from __future__ import annotations

from typing import Any

PROMPT_CONTEXT_TOKENS = (4, 24)  # the shortest clean prompt suffix in this range primes a sample


def prompt_context(tokenizer: Any, prompt_token_ids: list[int]) -> list[int]:
    """The prompt's last tokens a sample's text is decoded after, as vLLM primes its
    detokenizer: the shortest suffix of 4 to 24 tokens (the whole prompt when it is shorter)
    whose decode holds no U+FFFD (a character cut in two); none: no context. Decoding after
    them keeps the first generated word's leading space, which a SentencePiece decode of the
    output alone strips ("Once" -> "upon a time" instead of " upon a time"), so echo + text
    and prompt + text are the text of all the tokens."""
    low, high = PROMPT_CONTEXT_TOKENS
    ids = list(prompt_token_ids)
    # A prompt ending inside a character (up to 3 byte tokens of it): the context ends before
    # them, or the stream would hold their bytes and give the prompt's U+FFFD as the output's.
    for end in range(len(ids), max(len(ids) - 4, 0), -1):
        for n in range(min(low, end), min(end, high) + 1):
            suffix = ids[end - n:end]
            if "\ufffd" not in tokenizer.decode(suffix, skip_special_tokens=True):
                return suffix
    return []
