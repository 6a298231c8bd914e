"""Documents of a chosen token length for the KV-budget quality benchmark.

Sections of the Python language reference (``pydoc_data.topics``): long sections are cut at
paragraph boundaries into pieces, short ones are merged with their alphabetical neighbours, so
every document has between ``min_tokens`` and ``max_tokens`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.workloads import documents


@dataclass
class Doc:
    name: str
    text: str
    num_tokens: int


def _paragraphs(text: str) -> list[str]:
    return [p for p in (s.strip("\n") for s in text.split("\n\n")) if p.strip()]


def _pack(paras: list[tuple[str, int]], target: int, max_tokens: int) -> list[list[tuple[str, int]]]:
    """Greedy packing of (paragraph, tokens) into runs of about ``target`` tokens."""
    runs: list[list[tuple[str, int]]] = [[]]
    size = 0
    for p, n in paras:
        if runs[-1] and (size >= target or size + n > max_tokens):
            runs.append([])
            size = 0
        runs[-1].append((p, n))
        size += n
    return runs


def build_documents(
    tokenizer: Any, num_docs: int, min_tokens: int = 1000, max_tokens: int = 3000, target: int = 1200
) -> list[Doc]:
    """``num_docs`` documents of ``min_tokens``..``max_tokens`` tokens, taken round-robin over
    their source sections so the set is as varied as possible. Deterministic."""
    count = lambda s: len(tokenizer.encode(s))  # noqa: E731
    topics = sorted(documents(), key=lambda kv: kv[0])
    by_source: list[list[Doc]] = []
    small: list[tuple[str, str]] = []
    for name, text in topics:
        n = count(text)
        if n < min_tokens:
            small.append((name, text))
            continue
        paras = []
        for p in _paragraphs(text):
            pn = count(p)
            if pn > max_tokens:  # a huge table: split by lines
                paras += [(line, count(line)) for line in p.splitlines() if line.strip()]
            else:
                paras.append((p, pn))
        pieces = []
        for i, run in enumerate(_pack(paras, target, max_tokens)):
            body = "\n\n".join(p for p, _ in run)
            pieces.append(Doc(f"{name}#{i}", body, count(body)))
        if len(pieces) > 1 and pieces[-1].num_tokens < min_tokens:  # short tail joins its neighbour
            tail = pieces.pop()
            body = pieces[-1].text + "\n\n" + tail.text
            if count(body) <= max_tokens:
                pieces[-1] = Doc(pieces[-1].name, body, count(body))
        by_source.append([d for d in pieces if min_tokens <= d.num_tokens <= max_tokens])
    merged: list[Doc] = []
    names: list[str] = []
    parts: list[str] = []
    for name, text in small:  # short sections, merged alphabetically
        names.append(name)
        parts.append(text.strip("\n"))
        body = "\n\n".join(parts)
        n = count(body)
        if n >= target:
            if n <= max_tokens:
                merged.append(Doc("+".join(names), body, n))
            names, parts = [], []
    by_source += [[d] for d in merged]
    out: list[Doc] = []
    depth = 0
    while len(out) < num_docs and any(depth < len(s) for s in by_source):
        level = [s[depth] for s in by_source if depth < len(s)]
        # within a level, the shortest first (one piece per source keeps the set varied)
        out += sorted(level, key=lambda d: (d.num_tokens, d.name))[: num_docs - len(out)]
        depth += 1
    if len(out) < num_docs:
        raise ValueError(f"only {len(out)} documents of {min_tokens}-{max_tokens} tokens are available")
    return sorted(out, key=lambda d: d.name)
