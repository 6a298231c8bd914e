"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before ``@triton.jit`` decorates the kernels (at import of
``keyserve.kernels.paged_attention``), so it is set here, when pytest loads this directory.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest

os.environ["TRITON_INTERPRET"] = "1"

_MODULE = "keyserve.kernels.paged_attention"
if _MODULE in sys.modules:  # imported by an earlier test directory without the interpreter
    importlib.reload(sys.modules[_MODULE])


@pytest.fixture(scope="session")
def triton_kernels() -> ModuleType:
    """The Triton launchers (the module, not the package's same-named entry point)."""
    return importlib.import_module(_MODULE)
