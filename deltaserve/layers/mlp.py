"""SiLU-gated MLP: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.layers.linear import Linear


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, dtype)
        self.up_proj = Linear(hidden_size, intermediate_size, dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
