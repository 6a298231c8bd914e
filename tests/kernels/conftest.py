"""Kernel tests run the Triton kernels through Triton's interpreter on the CPU, or compiled on a GPU.

Without CUDA, ``TRITON_INTERPRET=1`` is set here, before ``@triton.jit`` decorates the kernels
(at the first import of ``keyserve.kernels.paged_attention``). With CUDA (and no explicit
``TRITON_INTERPRET=1``) the same tests run the compiled kernels: the ``triton_kernels``
fixture moves the tensors a test passes to the GPU and the results back, so tests are written
once, on CPU tensors.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

_MODULE = "keyserve.kernels.paged_attention"
_ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def _triton_imported_compiled() -> bool:
    """True if triton was imported before ``TRITON_INTERPRET=1`` was set: its own @jit helpers
    are then compiled-mode functions the interpreter cannot call."""
    standard = sys.modules.get("triton.language.standard")
    if standard is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return not isinstance(standard.zeros, InterpretedFunction)


if not _ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    if _triton_imported_compiled():
        raise pytest.UsageError(
            "triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it "
            "first); run the kernel tests from the repository's test suite or set "
            "TRITON_INTERPRET=1 in the environment")

_LAUNCHERS = ("write_kv", "paged_decode_attention", "paged_prefill_attention")


def _move(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        return tuple(_move(v, device) for v in x)
    return x


class _OnDevice:
    """The launchers module, with tensor arguments moved to ``device`` and results moved back
    (write_kv's caches are copied back into the caller's tensors)."""

    def __init__(self, module: ModuleType, device: torch.device) -> None:
        self._module, self._device = module, device

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._module, name)
        if name not in _LAUNCHERS or self._device.type == "cpu":
            return attr
        return self._wrap(name, attr)

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            moved = [_move(a, self._device) for a in args]
            result = fn(*moved, **{k: _move(v, self._device) for k, v in kwargs.items()})
            if name == "write_kv":
                args[2].copy_(moved[2].cpu())
                args[3].copy_(moved[3].cpu())
            return _move(result, torch.device("cpu"))

        return call


@pytest.fixture(scope="session")
def triton_kernels() -> _OnDevice:
    """The Triton launchers (the module, not the package's same-named entry point)."""
    device = torch.device("cuda" if _ON_GPU else "cpu")
    return _OnDevice(importlib.import_module(_MODULE), device)
