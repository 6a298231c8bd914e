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


def _primed_stream(ids: list[int]) -> Any:
    """A fresh ``DecodeStream`` that has seen ``ids`` (older tokenizers: a bare one)."""
    try:
        return DecodeStream(ids=list(ids), skip_special_tokens=True)
    except TypeError:  # pragma: no cover - tokenizers without a prefill
        return DecodeStream(skip_special_tokens=True)


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

    def __init__(self, tokenizer: Any, stop: list[str], context: list[int] | None = None) -> None:
        """``context``: the prompt's last tokens the text is decoded after (``prompt_context``'s
        choice, made once per request for all its samples); none: the output's own decode."""
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""
        self.stopped_at: int | None = None  # length of text before the stop string
        context = list(context or [])
        self._ids: list[int] = []
        self._backend = _stream_backend(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=True) if self._backend is not None else None
        self._pending: list[int] = []  # ids given since the stream's last piece (it holds them)
        self._context: list[int] = []  # the ids of that piece: decode context for ``_tail``
        self._prefix: list[int] = []  # the full-decode path: the output is decoded after these
        self._prefix_text = ""
        if self._stream is not None and context:
            self._prime(context)
        elif context:
            self._prefix, self._prefix_text = context, tokenizer.decode(context, skip_special_tokens=True)

    def _prime(self, context: list[int]) -> None:
        """Step the stream through the prompt's last tokens, discarding their text (a window
        the stream cannot decode leaves it fresh, without context)."""
        try:
            for token_id in context:
                self._stream.step(self._backend, token_id)
        except Exception:  # noqa: BLE001 — e.g. bytes the prompt cut in two: no context then
            self._stream = DecodeStream(skip_special_tokens=True)
            return
        self._context = context

    def _decode_output(self) -> str:
        """The full-decode path: the output's text after the prompt's context."""
        decode = self.tokenizer.decode
        if not self._prefix:
            return decode(self._ids, skip_special_tokens=True)
        full = decode(self._prefix + self._ids, skip_special_tokens=True)
        if full.startswith(self._prefix_text):
            return full[len(self._prefix_text):]
        return decode(self._ids, skip_special_tokens=True)

    def _tail(self, ids: list[int]) -> str:
        """The text ``ids`` add after the last piece's ids, as a full decode gives it (the
        context keeps a word-initial space that a decode starting at ``ids`` would strip)."""
        decode = self.tokenizer.decode
        base = decode(self._context, skip_special_tokens=True) if self._context else ""
        full = decode(self._context + ids, skip_special_tokens=True)
        return full[len(base):] if full.startswith(base) else decode(ids, skip_special_tokens=True)

    def append(self, token_id: int) -> str:
        """Add one token; return the newly visible text (empty while a stop string is held)."""
        previous = len(self.text)
        if self._stream is not None:
            self._pending.append(token_id)
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:  # noqa: BLE001 — invalid bytes rewrote the window: start afresh
                # The held ids' text from a full decode after the last piece, then a stream
                # that has seen them (a fresh one would drop the next word's leading space).
                piece = self._tail(self._pending)
                self._stream = _primed_stream(self._pending)
            if not piece:  # an incomplete UTF-8 sequence (or a skipped special token)
                return ""
            self._context, self._pending = self._pending, []
            self.text += piece
        else:
            self._ids.append(token_id)
            new_text = self._decode_output()
            if new_text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more bytes
                return ""
            self.text = new_text
        return self._check_stop(previous)

    def flush(self) -> str:
        """At the end of the sample: the text of the tokens still held -- a character cut short
        (shown as U+FFFD, as the tokenizer's decode shows it) or a trailing U+FFFD the model
        wrote, which the stream holds as if more bytes could follow -- checked for stop
        strings like any other text. Afterwards ``text`` holds the text of every token."""
        if self.stopped_at is not None:
            return ""
        previous = len(self.text)
        if self._stream is not None:
            if not self._pending:
                return ""
            piece = self._tail(self._pending)
            self._context, self._pending = self._pending, []
            self.text += piece
        else:
            new_text = self._decode_output()
            if len(new_text) <= previous or not new_text.startswith(self.text):
                return ""
            self.text = new_text
        return self._check_stop(previous)

    def _check_stop(self, previous: int) -> str:
        if self.stop:
            start = max(0, previous - self.max_stop_len + 1)
            hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.stopped_at = min(hits)
                self.text = self.text[: self.stopped_at]
                return self.text[previous:]
        return self.text[previous:]
