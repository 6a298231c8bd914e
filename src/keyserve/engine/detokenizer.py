"""Incremental detokenisation and stop-string detection for one sample."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Keeps the text of the generated tokens and finds stop strings as tokens arrive.

    Only the tail of the text can contain a new stop string, so each check scans the last
    ``len(new text) + longest stop - 1`` characters.
    """

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""
        self._ids: list[int] = []
        self.stopped_at: int | None = None  # length of text before the stop string

    def append(self, token_id: int) -> str:
        """Add one token; return the newly visible text (empty while a stop string is held)."""
        self._ids.append(token_id)
        new_text = self.tokenizer.decode(self._ids, skip_special_tokens=True)
        if new_text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more bytes
            return ""
        previous = len(self.text)
        self.text = new_text
        if self.stop:
            start = max(0, previous - self.max_stop_len + 1)
            hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.stopped_at = min(hits)
                self.text = self.text[: self.stopped_at]
                return self.text[previous:]
        return self.text[previous:]
