"""Poison values that get past admission, for the failure-isolation tests."""

from __future__ import annotations


class RaisesAfter(list):
    """stop_token_ids whose membership test breaks after ``n`` tokens: a fault mid-stream."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    def __contains__(self, item: object) -> bool:
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("stop check broke")
        return False
