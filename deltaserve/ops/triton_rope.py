"""Partial rotary embedding for CUDA GPUs (Triton): one kernel per tensor instead of torch's ~6
(two slices, a negation, two concatenations, multiplies and an add). Contract:
layers/rotary.apply_rotary, computed in fp32 and rounded once (tests/ops/test_triton_rope.py).
"""

from __future__ import annotations

import torch

from deltaserve.ops.backend import tl, triton
from deltaserve.ops.backend import triton_enabled as available  # noqa: F401 (callers ask here)

if triton is not None:

    @triton.jit
    def _rope_kernel(X, COS, SIN, Y, T, SX_H, SX_T, D, R: tl.constexpr, BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)  # one (head, position) row
        h, t = pid // T, pid % T
        d = tl.arange(0, BLOCK_D)
        half: tl.constexpr = R // 2
        row = X + h * SX_H + t * SX_T
        x = tl.load(row + d, mask=d < D, other=0.0).to(tl.float32)
        in_rot = d < R
        partner = tl.where(d < half, d + half, d - half)
        xp = tl.load(row + partner, mask=in_rot, other=0.0).to(tl.float32)
        c = tl.load(COS + t * R + d, mask=in_rot, other=1.0).to(tl.float32)
        s = tl.load(SIN + t * R + d, mask=in_rot, other=0.0).to(tl.float32)
        rotated = tl.where(d < half, -xp, xp)
        y = tl.where(in_rot, x * c + rotated * s, x)
        tl.store(Y + pid * D + d, y.to(Y.dtype.element_ty), mask=d < D)


def apply_rotary_cuda(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [1,H,T,D] (any strides with a unit last stride) -> contiguous [1,H,T,D]."""
    _, heads, seq_len, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(1, heads, seq_len, dim, dtype=x.dtype, device=x.device)
    rot = cos.shape[-1]
    _rope_kernel[(heads * seq_len,)](x, cos.contiguous(), sin.contiguous(), out, seq_len,
                                     x.stride(1), x.stride(2), dim, R=rot,
                                     BLOCK_D=triton.next_power_of_2(dim))
    return out
