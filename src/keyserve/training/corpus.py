"""Teacher-forced distillation data: the target's next-token distributions along real text.

The target's own chat answers are the best data for a draft, but they cost one target forward
per token (~25 tokens/s on 2 cores). Along a fixed text the target gives its distribution before
every token in one causal forward (prefill speed, ~1000 tokens/s in float32), so the draft can
see far more of how the target predicts. The text is what this machine holds offline -- Python's
language reference (``pydoc_data.topics``), the standard library's sources, the licences and
package descriptions that installed packages ship -- placed as the assistant's reply after a
short instruction in the target's chat template, so the draft learns the target's predictions
in the position it drafts from when serving.

Records are ``Answer``s like the chat answers (``records.py``), with ``prompt_index`` -1 - i for
passage i, so a resumed run knows which passages it already has.
"""

from __future__ import annotations

import random
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm

from keyserve.training.dense import DenseLlama
from keyserve.training.records import Answer

INSTRUCTIONS = (
    "Explain the following.",
    "Continue the text.",
    "Show me an example.",
    "Write the documentation for this.",
    "Summarize it for me.",
    "How does this work?",
)
MIN_PASSAGE_CHARS = 200
Item = tuple[int, list[int], list[int]]  # (prompt index, prompt ids, passage ids)


def _pydoc_topics() -> Iterator[str]:
    import pydoc_data.topics

    yield from (text for _, text in sorted(pydoc_data.topics.topics.items()))


def _files(root: Path, patterns: tuple[str, ...], limit_bytes: int = 200_000) -> Iterator[str]:
    if not root.is_dir():
        return
    for pattern in patterns:
        for path in sorted(root.glob(pattern)):
            try:
                if path.is_file() and 0 < path.stat().st_size <= limit_bytes:
                    yield path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue


def _stdlib_sources() -> Iterator[str]:
    yield from _files(Path(sysconfig.get_paths()["stdlib"]), ("*.py", "*/*.py"))


def _package_texts() -> Iterator[str]:
    """Licences and long descriptions of the installed packages (their METADATA files)."""
    site = Path(sysconfig.get_paths()["purelib"])
    yield from _files(site, ("*.dist-info/METADATA", "*.dist-info/LICENSE*", "*.dist-info/licenses/*"))
    yield from _files(Path("/usr/share/common-licenses"), ("*",))


SOURCES: dict[str, Callable[[], Iterator[str]]] = {
    "pydoc_topics": _pydoc_topics,
    "stdlib": _stdlib_sources,
    "packages": _package_texts,
}


def _paragraph_chunks(text: str, max_chars: int) -> Iterator[str]:
    """Consecutive paragraphs joined up to ``max_chars`` characters."""
    chunk = ""
    for para in text.split("\n\n"):
        if chunk and len(chunk) + len(para) + 2 > max_chars:
            yield chunk
            chunk = ""
        chunk = f"{chunk}\n\n{para}" if chunk else para
        while len(chunk) > max_chars:  # one paragraph longer than a passage
            yield chunk[:max_chars]
            chunk = chunk[max_chars:]
    if chunk:
        yield chunk


def passages(max_chars: int = 1200, seed: int = 0) -> list[str]:
    """Every source cut into passages of at most ``max_chars`` characters, sources interleaved
    (round robin) and each source's passages shuffled, so a prefix of the list mixes all kinds."""
    rng = random.Random(seed)
    per_source = []
    for name in sorted(SOURCES):
        cut = [p for text in SOURCES[name]() for p in _paragraph_chunks(text, max_chars)
               if len(p.strip()) >= MIN_PASSAGE_CHARS]
        rng.shuffle(cut)
        per_source.append(cut)
    out: list[str] = []
    for i in range(max((len(s) for s in per_source), default=0)):
        out.extend(s[i] for s in per_source if i < len(s))
    return out


def chat_items(tokenizer, texts: list[str], max_tokens: int, seed: int) -> list[tuple[list[int], list[int]]]:  # noqa: ANN001
    """(prompt ids, passage ids) per text: an instruction in the chat template, then the passage
    as the assistant's reply (at most ``max_tokens`` tokens; plain text for models without a
    chat template)."""
    rng = random.Random(seed + 7)
    out = []
    chat = bool(getattr(tokenizer, "chat_template", None))
    for text in texts:
        body = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
        if chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": rng.choice(INSTRUCTIONS)}],
                                                add_generation_prompt=True)
            prompt = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            prompt = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else body[:1]
            body = body if tokenizer.bos_token_id is not None else body[1:]
        if len(body) >= 2:
            out.append((prompt, body))
    return out


@torch.inference_mode()
def teacher_force(
    teacher: DenseLlama,
    items: list[Item],
    top_k: int,
    batch_tokens: int = 4096,
    logit_rows: int = 512,
) -> list[Answer]:
    """The target's top-k log-probabilities before every passage token, one causal forward per
    batch of similar-length items (right padding only follows each row's own tokens)."""
    answers: list[Answer] = []
    order = sorted(range(len(items)), key=lambda i: len(items[i][1]) + len(items[i][2]))
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order):
            width = len(items[order[end]][1]) + len(items[order[end]][2])
            if width * (end - start + 1) > batch_tokens:
                break
            end += 1
        batch = [items[i] for i in order[start:end]]
        width = max(len(p) + len(t) for _, p, t in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.int64)
        for r, (_, p, t) in enumerate(batch):
            ids[r, : len(p) + len(t)] = torch.tensor(p + t)
        positions = torch.arange(width).expand(len(batch), width)
        hidden = teacher(ids, positions)  # [B, width, hidden]
        for r, (index, p, t) in enumerate(batch):
            rows = hidden[r, len(p) - 1 : len(p) - 1 + len(t)]  # [len(t), hidden]: predict t
            lps, tops = [], []
            for c in range(0, rows.shape[0], logit_rows):
                logprobs = torch.log_softmax(teacher.logits(rows[c : c + logit_rows]), dim=-1)
                lp, top = logprobs.topk(top_k, dim=-1)
                lps.append(lp.to(torch.float16))
                tops.append(top.to(torch.int32))
            answers.append(Answer(index, list(p), list(t), torch.cat(tops), torch.cat(lps)))
        start = end
    return answers


def record_corpus(
    force: Callable[[list[Item], int], list[Answer]],
    tokenizer,  # noqa: ANN001
    done: set[int],
    on_save: Callable[[list[Answer]], None],
    deadline: float,
    max_tokens: int,
    top_k: int,
    seed: int,
    passage_tokens: int = 256,
    save_every: int = 64,
) -> int:
    """Teacher-force passages not in ``done`` (their prompt indices) until ``max_tokens`` tokens
    or ``deadline`` (``time.monotonic()``); parts go to ``on_save``. ``force(items, top_k)``
    records a list of items: ``teacher_force`` over a dense model, or
    ``engine_answers.engine_teacher_force`` over the serving engine. Returns tokens recorded."""
    texts = passages(seed=seed)
    items = chat_items(tokenizer, texts, passage_tokens, seed)
    todo = [(-1 - i, p, t) for i, (p, t) in enumerate(items) if -1 - i not in done]
    recorded = 0
    bar = tqdm(total=max_tokens, desc="teacher-forced text", unit="tok", dynamic_ncols=True)
    for c in range(0, len(todo), save_every):
        if recorded >= max_tokens or time.monotonic() > deadline:
            break
        chunk = todo[c : c + save_every]
        answers = force(chunk, top_k)
        on_save(answers)
        n = sum(len(a.tokens) for a in answers)
        recorded += n
        bar.update(n)
    bar.close()
    return recorded
