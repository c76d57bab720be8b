"""What a decode GEMV may compute from its input before the dot: the MLP's two seams.

At batch 1 the MLP of a decode step is five kernels: add + RMSNorm, gate|up GEMV, silu * mul, down
GEMV, and the next norm. The norm and silu*mul are one tiny program each (a 1,024- or 3,584-wide
row), so each costs a launch and a dependent round trip (~2-3 us on an H200) for nanoseconds of
math. Here the GEMV computes them itself, every program for the whole row it reads (L2-resident,
a few KB), so the MLP is two GEMVs:

  AddNorm  the GEMV's x is rms_norm(residual + addend) (ops/norm.add_rms_norm's contract); program 0
           also stores residual + addend, the residual stream the caller keeps.
  SiluMul  the GEMV's x is silu(gate) * up of a gate|up row [2K] (ops/activation.silu_mul).

Both round where the separate kernels round (the sum and the normed row to the residual's dtype,
silu*mul to its input's), so the fused GEMV sees the values the unfused kernels would write; only
the norm's sum of squares may be reduced in another order (a last-bit difference in its rstd).
`apply_ref` is the contract: the separate ops, then the GEMV on their output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.ops.backend import tl, triton


@dataclass(frozen=True, slots=True)
class AddNorm:
    """x is the addend; residual [1, K]; weight [K] the norm's (stored minus `offset`); total [1, K]
    receives residual + x (caller-allocated, the residual's dtype)."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    offset: float
    total: torch.Tensor


@dataclass(frozen=True, slots=True)
class SiluMul:
    """x is a gate|up row [1, 2K]; the GEMV's K is half its width."""


Prologue = AddNorm | SiluMul


def gemv_cols(x: torch.Tensor, prologue: Prologue | None) -> int:
    """The GEMV's K for an input row x under `prologue`."""
    return x.shape[-1] // 2 if isinstance(prologue, SiluMul) else x.shape[-1]


def apply_ref(x: torch.Tensor, prologue: Prologue | None) -> torch.Tensor:
    """The GEMV's input computed by the separate ops (fills AddNorm.total): the reference, and the
    path for GEMVs without a fused kernel."""
    from deltaserve.ops.activation import silu_mul
    from deltaserve.ops.norm import add_rms_norm

    if prologue is None:
        return x
    if isinstance(prologue, SiluMul):
        return silu_mul(x)
    h, total = add_rms_norm(x, prologue.residual, prologue.weight, prologue.eps, prologue.offset)
    prologue.total.copy_(total)
    return h


def kernel_args(x: torch.Tensor, prologue: Prologue | None) -> dict:
    """The kernels' prologue arguments: XMODE 0 plain, 1 AddNorm, 2 SiluMul."""
    if isinstance(prologue, AddNorm):
        return {"R": prologue.residual, "NW": prologue.weight, "TOTAL": prologue.total,
                "eps": prologue.eps, "offset": prologue.offset, "XMODE": 1,
                "NORM_BLOCK": triton.next_power_of_2(x.shape[-1])}
    return {"R": x, "NW": x, "TOTAL": x, "eps": 0.0, "offset": 0.0,
            "XMODE": 2 if isinstance(prologue, SiluMul) else 0, "NORM_BLOCK": 16}


def check(x: torch.Tensor, prologue: Prologue | None, k: int) -> None:
    """Shapes the fused kernels rely on; a mismatch is a caller's bug, named here."""
    if isinstance(prologue, SiluMul) and x.shape[-1] != 2 * k:
        raise ValueError(f"SiluMul GEMV: x must be [1, {2 * k}], got {list(x.shape)}")
    if isinstance(prologue, AddNorm):
        for name in ("residual", "total"):
            t = getattr(prologue, name)
            if t.numel() != x.numel() or not t.is_contiguous() or t.dtype != x.dtype:
                raise ValueError(f"AddNorm GEMV: {name} must be a contiguous {x.dtype} row of "
                                 f"{x.numel()}, got {list(t.shape)} {t.dtype}")


if triton is not None:

    @triton.jit
    def rstd_of(X, R, K, eps, S, pid, XMODE: tl.constexpr, NORM_BLOCK: tl.constexpr):
        """AddNorm: 1 / rms of the rounded sum (every program); program 0 stores the sum to S.
        Other modes: 1.0 (unused)."""
        if XMODE == 1:
            cols = tl.arange(0, NORM_BLOCK)
            ok = cols < K
            s = (tl.load(X + cols, mask=ok, other=0.0).to(tl.float32)
                 + tl.load(R + cols, mask=ok, other=0.0).to(tl.float32)).to(S.dtype.element_ty)
            tl.store(S + cols, s, mask=ok & (pid == 0))
            sf = s.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(sf * sf, 0) / K + eps)
        else:
            rstd = 1.0
        return rstd

    @triton.jit
    def x_at(X, R, NW, idx, ok, K, rstd, offset, XMODE: tl.constexpr):
        """The GEMV input at positions idx as fp32, computed and rounded as the separate kernel
        would have written it."""
        if XMODE == 1:
            s = (tl.load(X + idx, mask=ok, other=0.0).to(tl.float32)
                 + tl.load(R + idx, mask=ok, other=0.0).to(tl.float32)).to(R.dtype.element_ty)
            w = tl.load(NW + idx, mask=ok, other=0.0).to(tl.float32) + offset
            x = (s.to(tl.float32) * rstd * w).to(R.dtype.element_ty).to(tl.float32)
        elif XMODE == 2:
            g = tl.load(X + idx, mask=ok, other=0.0).to(tl.float32)
            u = tl.load(X + K + idx, mask=ok, other=0.0).to(tl.float32)
            x = (g / (1.0 + tl.exp(-g)) * u).to(X.dtype.element_ty).to(tl.float32)
        else:
            x = tl.load(X + idx, mask=ok, other=0.0).to(tl.float32)
        return x
