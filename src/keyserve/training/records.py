"""The target's answers and its next-token distributions, as flat tensors on disk.

Generation is the slowest stage of distillation, so its output is saved in parts as it goes
(safetensors: plain tensors, no pickle) and a resumed run reads them back instead of asking
the target again. Distributions are stored as the target's top-k log-probabilities: enough for
the distillation loss (almost all of a small model's mass sits in its top few dozen tokens) at
a few bytes per position instead of a full-vocabulary row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


@dataclass
class Answer:
    """One prompt and what the target generated for it."""

    prompt_index: int
    prompt: list[int]
    tokens: list[int]  # generated tokens, in order
    topk_ids: torch.Tensor  # [len(tokens), k] int32: the target's top-k before each token
    topk_logprobs: torch.Tensor  # [len(tokens), k] float16: their log-probabilities (T = 1)


@dataclass
class TeacherData:
    """Many answers, concatenated; ``*_offsets`` delimit sequence ``i``."""

    prompt_index: torch.Tensor  # [S] int64
    prompt_offsets: torch.Tensor  # [S + 1] int64
    prompt_tokens: torch.Tensor  # [P] int64
    gen_offsets: torch.Tensor  # [S + 1] int64
    gen_tokens: torch.Tensor  # [G] int64
    topk_ids: torch.Tensor  # [G, k] int32
    topk_logprobs: torch.Tensor  # [G, k] float16

    @property
    def num_sequences(self) -> int:
        return int(self.prompt_index.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.gen_tokens.numel())

    def answer(self, i: int) -> Answer:
        p0, p1 = int(self.prompt_offsets[i]), int(self.prompt_offsets[i + 1])
        g0, g1 = int(self.gen_offsets[i]), int(self.gen_offsets[i + 1])
        return Answer(
            int(self.prompt_index[i]),
            self.prompt_tokens[p0:p1].tolist(),
            self.gen_tokens[g0:g1].tolist(),
            self.topk_ids[g0:g1],
            self.topk_logprobs[g0:g1],
        )

    @classmethod
    def from_answers(cls, answers: list[Answer], k: int) -> TeacherData:
        def offsets(lengths: list[int]) -> torch.Tensor:
            return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)

        def cat(parts: list[torch.Tensor], dtype: torch.dtype, width: int | None) -> torch.Tensor:
            shape = (0,) if width is None else (0, width)
            return torch.cat(parts).to(dtype) if parts else torch.empty(shape, dtype=dtype)

        longs = [torch.tensor(a.prompt, dtype=torch.int64) for a in answers]
        gens = [torch.tensor(a.tokens, dtype=torch.int64) for a in answers]
        return cls(
            prompt_index=torch.tensor([a.prompt_index for a in answers], dtype=torch.int64),
            prompt_offsets=offsets([len(a.prompt) for a in answers]),
            prompt_tokens=cat(longs, torch.int64, None),
            gen_offsets=offsets([len(a.tokens) for a in answers]),
            gen_tokens=cat(gens, torch.int64, None),
            topk_ids=cat([a.topk_ids for a in answers], torch.int32, k),
            topk_logprobs=cat([a.topk_logprobs for a in answers], torch.float16, k),
        )

    @classmethod
    def concat(cls, parts: list[TeacherData]) -> TeacherData:
        answers = [p.answer(i) for p in parts for i in range(p.num_sequences)]
        k = parts[0].topk_ids.shape[1] if parts else 1
        return cls.from_answers(answers, k)

    def save(self, path: Path) -> None:
        """Write atomically (temp file + rename) so an interrupted run leaves no torn part."""
        tmp = path.with_suffix(".tmp")
        save_file({name: getattr(self, name).contiguous() for name in _FIELDS}, str(tmp))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> TeacherData:
        tensors = load_file(str(path))
        return cls(**{name: tensors[name] for name in _FIELDS})


_FIELDS = (
    "prompt_index",
    "prompt_offsets",
    "prompt_tokens",
    "gen_offsets",
    "gen_tokens",
    "topk_ids",
    "topk_logprobs",
)


def recorded_top_k(directory: Path) -> set[int]:
    """The top-k widths of the parts under ``directory``, read from their headers (no tensor is
    loaded): a run checks another run's data against its own before recording anything."""
    widths = set()
    for path in sorted(directory.glob("part-*.safetensors")):
        with safe_open(str(path), "pt") as f:
            widths.add(int(f.get_slice("topk_ids").get_shape()[1]))
    return widths


def load_parts(directory: Path) -> TeacherData | None:
    """Every saved part under ``directory`` as one ``TeacherData`` (None when there is none)."""
    parts = sorted(directory.glob("part-*.safetensors"))
    if not parts:
        return None
    return TeacherData.concat([TeacherData.load(p) for p in parts])
