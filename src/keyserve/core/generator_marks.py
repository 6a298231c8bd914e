"""A seeded request's random stream as a function of its tokens, not of the steps that ran.

A sequence's generator advances every time a step samples it. If a step runs but its tokens
never reach the engine (a Ray actor died after the shards sampled, and the compiled graph was
torn down before the driver read the result), the engine schedules that step again, and a
generator that simply went on would draw different numbers for the same token: the seeded
request would no longer equal its run without the fault. So before a sequence's draws, the
generator is marked with the number of tokens the sequence has; a step for the same number
rewinds it to that mark. One mark per sequence suffices: at most one unacknowledged step per
sequence is ever in flight. The same mark serves a batched stage that raised after its draws
(one row's ``top_logprobs`` broke after every row sampled): each row, run again alone, is
rewound to it first, so it draws what it drew in the batch. Pure torch: the model runner
(target side) and the drafter share it.
"""

from __future__ import annotations

import torch


class GeneratorMarks:
    """The state of each seeded sequence's generator before the draws of its latest step."""

    def __init__(self) -> None:
        self._marks: dict[int, tuple[int, torch.Tensor]] = {}  # seq_id -> (tokens, state)

    def before_draws(self, seq_id: int, generator: torch.Generator | None, num_tokens: int) -> None:
        """Call before the sequence's draws for a step at ``num_tokens`` generated tokens:
        the same point as the last mark rewinds the generator there; a later point marks it."""
        if generator is None:
            return
        mark = self._marks.get(seq_id)
        if mark is not None and mark[0] == num_tokens:
            generator.set_state(mark[1])
        else:
            self._marks[seq_id] = (num_tokens, generator.get_state())

    def rewind(self, seq_id: int, generator: torch.Generator | None) -> None:
        """Back to the sequence's latest mark (its state before this step's draws), so a
        stage run again row by row draws what the batch drew."""
        mark = self._marks.get(seq_id)
        if generator is not None and mark is not None:
            generator.set_state(mark[1])

    def drop(self, seq_id: int) -> None:
        self._marks.pop(seq_id, None)

    def clear(self) -> None:
        self._marks.clear()

    def __len__(self) -> int:
        return len(self._marks)
