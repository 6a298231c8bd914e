"""Reusable scratch tensors, per thread: the CPU kernels' gathers and products write into them
instead of a fresh multi-MB tensor per call, whose page faults rival the work itself."""

from __future__ import annotations

import threading

import torch

# Per thread: tensor-parallel ranks may run as threads of one process (tests do).
_local = threading.local()


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A scratch tensor of ``shape`` kept under ``name`` (grown, never shrunk)."""
    numel = 1
    for n in shape:
        numel *= n
    buffers: dict[tuple[str, torch.dtype, torch.device, bool], torch.Tensor]
    buffers = _local.__dict__.setdefault("buffers", {})
    # Tensors made under inference_mode cannot be written outside it (and vice versa for
    # autograd tracking), so buffers are kept per mode.
    key = (name, dtype, torch.device(device), torch.is_inference_mode_enabled())
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        buffers[key] = buf
    return buf[:numel].view(shape)
