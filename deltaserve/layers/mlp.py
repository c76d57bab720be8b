"""SiLU-gated MLP: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.layers.linear import Linear
from deltaserve.ops.gemv_prologue import Prologue, SiluMul


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = Linear(
            hidden_size, [intermediate_size] * 2, dtype, parts=["gate_proj", "up_proj"]
        )
        self.down_proj = Linear(intermediate_size, hidden_size, dtype)

    def forward(self, x: torch.Tensor, prologue: Prologue | None = None) -> torch.Tensor:
        """prologue: what gate|up's GEMV computes from x first (ops/gemv_prologue). silu * mul is
        down's prologue: inside its GEMV for a decode row on the Triton GEMVs (two kernels for the
        MLP), else the separate op (Linear.forward)."""
        return self.down_proj(self.gate_up_proj(x, prologue), SiluMul())
