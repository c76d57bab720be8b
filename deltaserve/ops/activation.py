"""The MLP's gate: silu(gate) * up over the two halves of the packed gate|up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.ops.norm import cuda_kernel_rows


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] -> silu(gate) * up [..., I], in gate_up's dtype (torch's two ops)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Same contract as silu_mul_ref (the Triton kernel computes in fp32 and rounds once)."""
    if cuda_kernel_rows(gate_up):
        from deltaserve.ops import triton_act

        if triton_act.available():
            return triton_act.silu_mul_cuda(gate_up)
    return silu_mul_ref(gate_up)
