"""e2e fixtures: one live server per test module (see live_server.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def stories_server_options(stories_path: str) -> dict:
    return {"model": stories_path, "num_blocks": 512, "seed": 0}
