"""The config's check of ``speculative_tree`` (it may not import core) accepts exactly the
shapes ``core.spec_tree.TreeShape.parse`` accepts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from keyserve.config import SpeculativeConfig
from keyserve.core.spec_tree import TreeShape


@pytest.mark.parametrize("text", ["2", "3x2", " 3X2 ", "1x1x1", "62", "63", "7x7", "7x8", "3x0", "x2", "", "2xa",
                                  "-1", "2x", "4x4x2"])
def test_config_and_tree_shape_agree(text: str) -> None:
    try:
        TreeShape.parse(text)
        parses = True
    except ValueError:
        parses = False
    try:
        SpeculativeConfig(speculative_tree=text)
        valid = True
    except ValidationError:
        valid = False
    assert valid == parses, text
