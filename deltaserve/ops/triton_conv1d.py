"""The GDN short convolution over a prefill chunk for CUDA GPUs (Triton): causal depthwise conv
(width W, the carried window supplying the first W-1 inputs) and SiLU in one pass, fp32 sums,
one rounding; torch's form is a concatenation, W multiply-adds and a SiLU over [T, C] each.
Contract: ops/conv1d.causal_conv1d_ref (tests/ops/test_triton_conv1d.py). The new window (the
last W-1 inputs) is a small torch slice in ops/conv1d.
"""

from __future__ import annotations

import torch

from deltaserve.ops.backend import tl, triton
from deltaserve.ops.backend import triton_enabled as available  # noqa: F401 (callers ask here)

BLOCK_T, BLOCK_C = 32, 128

if triton is not None:

    @triton.jit
    def _conv_prefill_kernel(X, WIN, CW, Y, T, C, X_STRIDE, W: tl.constexpr,
                             BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        b, pt, pc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        ts = pt * BLOCK_T + tl.arange(0, BLOCK_T)
        cs = pc * BLOCK_C + tl.arange(0, BLOCK_C)
        t_ok, c_ok = ts < T, cs < C
        x_base = X + b * T * X_STRIDE
        win = WIN + b * C * (W - 1)
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        for j in tl.static_range(W):
            src = ts + j - (W - 1)  # the input this tap reads: the chunk's, or the window's
            from_x = t_ok[:, None] & c_ok[None, :] & (src >= 0)[:, None]
            from_w = t_ok[:, None] & c_ok[None, :] & (src < 0)[:, None]
            xv = tl.load(x_base + src[:, None] * X_STRIDE + cs[None, :], mask=from_x, other=0.0)
            wv = tl.load(win + cs[None, :] * (W - 1) + (src + W - 1)[:, None], mask=from_w,
                         other=0.0)
            tap = tl.load(CW + cs * W + j, mask=c_ok, other=0.0)
            acc += (xv.to(tl.float32) + wv.to(tl.float32)) * tap[None, :]
        out = acc / (1.0 + tl.exp(-acc))
        tl.store(Y + (b * T + ts[:, None]) * C + cs[None, :], out.to(Y.dtype.element_ty),
                 mask=t_ok[:, None] & c_ok[None, :])


def causal_conv1d_cuda(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor
                       ) -> torch.Tensor:
    """x [B,T,C] (unit column stride, any row stride); weight [C,W]; window [B,C,W-1] ->
    silu(conv(x)) [B,T,C] in x's dtype."""
    bsz, seq_len, channels = x.shape
    if x.stride(-1) != 1 or x.stride(0) != seq_len * x.stride(1):
        x = x.contiguous()
    out = torch.empty(bsz, seq_len, channels, dtype=x.dtype, device=x.device)
    grid = (bsz, triton.cdiv(seq_len, BLOCK_T), triton.cdiv(channels, BLOCK_C))
    _conv_prefill_kernel[grid](x, window.contiguous(), weight.float().contiguous(), out, seq_len,
                               channels, x.stride(1), W=weight.shape[-1], BLOCK_T=BLOCK_T,
                               BLOCK_C=BLOCK_C)
    return out
