"""RMSNorms of Qwen3.5: zero-centred (1+w) for the residual stream and q/k, plain-w gated for GDN."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.ops.gemv_prologue import AddNorm
from deltaserve.ops.norm import add_rms_norm, gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2) + eps) * (1 + w), computed in fp32; w is stored zero-centred."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, 1.0)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add fused into the norm on GPUs."""
        return add_rms_norm(x, residual, self.weight, self.eps, 1.0)

    def add_prologue(self, residual: torch.Tensor) -> AddNorm:
        """add_forward for a GEMV to compute in its prologue: the sum lands in .total."""
        return AddNorm(residual.contiguous(), self.weight, self.eps, 1.0,
                       torch.empty_like(residual, memory_format=torch.contiguous_format))


class GatedRMSNorm(nn.Module):
    """y = rms_norm(x) * w * silu(z) over the last dim (norm before gate); w is plain (init 1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), False)

    def forward(self, x: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """x [..., N]; z of x's shape, or [R, G*N] (G heads per row: a projection's view)."""
        return gated_rms_norm(x, z, self.weight, self.eps, out_dtype)
