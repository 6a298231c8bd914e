"""RMSNorm with the exact rounding of Hugging Face's ``LlamaRMSNorm``."""

from __future__ import annotations

import torch
from torch import nn

from keyserve.kernels.native import elementwise as native


class RMSNorm(nn.Module):
    """``weight * (x / rms(x))`` computed in float32.

    For float32 inputs torch's fused ``rms_norm`` gives the same bits as transformers' four-op
    version in one kernel. For lower precision transformers rounds the normalised value to the
    input dtype *before* multiplying by the weight; we keep that order so bfloat16 runs match.
    """

    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.eps = eps
        self.shape = (hidden_size,)
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        if native.supports(x, self.weight):  # one pass instead of six (kernels/native/elementwise.c)
            return native.add_rms_norm(x, None, self.weight, self.eps)[1]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return torch.rms_norm(x, self.shape, self.weight, self.eps)
        normed = torch.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)
        return self.weight * normed

    def add_forward(
        self,
        h: torch.Tensor,  # [n, hidden]: the residual stream
        y: torch.Tensor,  # [n, hidden]: what a sublayer adds to it
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (h + y, rms_norm(h + y)): [n, hidden] each
        """The residual sum and its norm: one native pass on the CPU, two ops elsewhere."""
        if native.supports(h, y, self.weight):
            return native.add_rms_norm(h, y, self.weight, self.eps)
        h = h + y
        return h, self(h)
