"""The one Linear every model layer builds: dense weights now, quantized variants plug in here."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# At or above this many rows a bf16/fp16 weight is widened once to the activation dtype and the
# GEMM runs there (CPUs without AMX run fp32 GEMMs ~1.6x faster than bf16); below it the GEMV
# reads the narrow weight directly, since decode is bound by weight bytes.
WIDEN_MIN_ROWS = 16


class Linear(nn.Module):
    """y = x W^T with W [out, in] stored in `dtype`; x and y in the caller's activation dtype."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype == x.dtype:
        return F.linear(x, weight)
    rows = x.numel() // x.shape[-1]
    if rows >= WIDEN_MIN_ROWS:
        return F.linear(x, weight.to(x.dtype))
    return F.linear(x.to(weight.dtype), weight).to(x.dtype)
