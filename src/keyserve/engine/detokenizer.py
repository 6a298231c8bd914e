"""Incremental detokenisation and stop-string detection for one sample."""

from __future__ import annotations

from typing import Any

try:  # the Rust incremental decoder (tokenizers >= 0.21)
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: the full-decode path below
    DecodeStream = None


def _stream_backend(tokenizer: Any) -> Any | None:
    """The fast tokenizer's Rust object when its incremental decode gives exactly what
    ``tokenizer.decode(ids, skip_special_tokens=True)`` gives (transformers' space clean-up
    is a Python post-pass the stream does not apply)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if DecodeStream is None or backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class IncrementalDetokenizer:
    """Keeps the text of the generated tokens and finds stop strings as tokens arrive.

    Each token costs one call of the tokenizer's Rust ``DecodeStream``, which decodes only a
    short window behind the new token: constant time per token (decoding the whole output
    again every step made a long request's text cost grow with the square of its length). The
    text only ever grows, so streamed pieces always add up to it. A full decode is not
    append-only where sampled bytes are not UTF-8 (a byte turns into U+FFFD once the next one
    arrives); there the stream keeps what it emitted and starts afresh. Tokenizers without a
    Rust backend decode the whole output each time. Only the tail of the text can contain a
    new stop string, so each check scans the last ``len(new text) + longest stop - 1``
    characters.
    """

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""
        self._ids: list[int] = []
        self.stopped_at: int | None = None  # length of text before the stop string
        self._backend = _stream_backend(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=True) if self._backend is not None else None

    def append(self, token_id: int) -> str:
        """Add one token; return the newly visible text (empty while a stop string is held)."""
        previous = len(self.text)
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:  # noqa: BLE001 — invalid bytes rewrote the window: start afresh
                self._stream = DecodeStream(skip_special_tokens=True)
                piece = self._stream.step(self._backend, token_id)
            if not piece:  # an incomplete UTF-8 sequence (or a skipped special token)
                return ""
            self.text += piece
        else:
            self._ids.append(token_id)
            new_text = self.tokenizer.decode(self._ids, skip_special_tokens=True)
            if new_text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more bytes
                return ""
            self.text = new_text
        if self.stop:
            start = max(0, previous - self.max_stop_len + 1)
            hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.stopped_at = min(hits)
                self.text = self.text[: self.stopped_at]
                return self.text[previous:]
        return self.text[previous:]
