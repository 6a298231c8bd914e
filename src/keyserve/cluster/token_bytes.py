"""A token's own bytes, as OpenAI's chat logprobs report them (``bytes``): a token that holds
part of a UTF-8 character decodes to U+FFFD alone, so its bytes must come from the vocabulary,
not from its text. Byte-level BPE (GPT-2 / SmolLM2) spells each byte as one printable
character; SentencePiece byte fallback spells a lone byte ``<0xXX>``."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's map from its printable characters back to the bytes they stand for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_types(tokenizer: Any) -> set[str]:
    """Every decoder type in the tokenizer's decoder, a ``Sequence``'s members included."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    found: set[str] = set()
    todo = [json.loads(backend.to_str()).get("decoder") or {}]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                found.add(node["type"])
            todo.extend(node.get("decoders") or [])
    return found


class TokenBytes:
    """Each token's bytes for one tokenizer (a special token: none)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.byte_level = "ByteLevel" in _decoder_types(tokenizer)
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def of(self, token_id: int, text: str) -> list[int]:
        """The bytes of one token whose decoded piece is ``text``, from the vocabulary: a
        byte-level BPE token's characters mapped back to bytes, a ``<0xXX>`` byte-fallback token's
        byte, a SentencePiece piece with its ``▁`` as a space (so a word's leading space is its
        own, whatever the decode around it strips); ``text``'s UTF-8 for anything else. A
        character split over tokens comes back whole from their bytes."""
        if token_id in self.special:
            return []
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self.byte_level:
                alphabet = _byte_level_alphabet()
                if all(c in alphabet for c in piece):
                    return [alphabet[c] for c in piece]
            else:
                match = _BYTE_TOKEN.match(piece)
                if match:
                    return [int(match.group(1), 16)]
                return list(piece.replace("\u2581", " ").encode())  # SentencePiece: ▁ is a space
        return list(text.encode())
