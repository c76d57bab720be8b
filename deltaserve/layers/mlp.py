"""SiLU-gated MLP: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.layers.linear import Linear
from deltaserve.ops.activation import silu_mul
from deltaserve.ops.gemv_prologue import Prologue, SiluMul


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = Linear(
            hidden_size, [intermediate_size] * 2, dtype, parts=["gate_proj", "up_proj"]
        )
        self.down_proj = Linear(intermediate_size, hidden_size, dtype)

    def forward(self, x: torch.Tensor, prologue: Prologue | None = None) -> torch.Tensor:
        """prologue: what gate|up's GEMV computes from x first (ops/gemv_prologue). A decode row
        on the Triton GEMVs also runs silu * mul inside the down GEMV: two kernels for the MLP."""
        gate_up = self.gate_up_proj(x, prologue)
        if self.down_proj.fuses_prologue(gate_up):
            return self.down_proj(gate_up, SiluMul())
        return self.down_proj(silu_mul(gate_up))
