"""Fixtures of the deployment tests: the objects each values case renders."""

from __future__ import annotations

from typing import Any

import pytest

from chart_render import VALUES_CASES, render_objects, values_for


@pytest.fixture(scope="session")
def rendered_cases() -> dict[str, list[dict[str, Any]]]:
    """Values case (the defaults or a ci/ file name) -> the objects it renders, once per session."""
    pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is not installed")
    return {case: render_objects(values_for(case)) for case in VALUES_CASES}
