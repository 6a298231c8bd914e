"""A copy derived from a weight tensor (a packed layout), made at first use and kept while the
weight lives: made again if the weight is written in place, dropped when it is freed."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch


def _version(weight: torch.Tensor) -> int:
    """The in-place write counter (inference tensors have none: they cannot be written to
    outside inference mode, and the engine does not write its weights)."""
    return -1 if weight.is_inference() else weight._version


class PerWeight:
    """``cache(weight)`` is ``make(weight)``, computed once per weight. ``id(weight) in cache``
    and ``cache[id(weight)]`` look without making."""

    def __init__(self, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._make = make
        self._entries: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        key = id(weight)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is weight and entry[1] == _version(weight):
            return entry[2]
        derived = self._make(weight)
        self._entries[key] = (weakref.ref(weight, lambda _ref, k=key: self._entries.pop(k, None)),
                              _version(weight), derived)
        return derived

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def __getitem__(self, key: int) -> torch.Tensor:
        return self._entries[key][2]
