"""SiLU-gated MLP: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.layers.linear import Linear
from deltaserve.ops.activation import silu_mul


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = Linear(
            hidden_size, [intermediate_size] * 2, dtype, parts=["gate_proj", "up_proj"]
        )
        self.down_proj = Linear(intermediate_size, hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))
