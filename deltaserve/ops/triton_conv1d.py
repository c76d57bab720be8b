"""The GDN short convolution over a prefill chunk for CUDA GPUs (Triton): causal depthwise conv
(width W, the carried window supplying the first W-1 inputs) and SiLU in one pass, fp32 sums,
one rounding; torch's form is a concatenation, W multiply-adds and a SiLU over [T, C] each.
Contract: ops/conv1d.causal_conv1d_ref (tests/ops/test_triton_conv1d.py). The new window (the
last W-1 inputs) is a small torch slice in ops/conv1d.

causal_conv1d_qkv_cuda also splits the output into contiguous q, k and v and L2-normalises each
q and k head: what fla's stages read, without the three copies and two norm launches a layer
otherwise pays before the scan (2.5 ms of an 8k prefill's 32 ms on the H200).
"""

from __future__ import annotations

import torch

from deltaserve.ops.backend import tl, triton
from deltaserve.ops.backend import triton_enabled as available  # noqa: F401 (callers ask here)

BLOCK_T, BLOCK_C, NUM_WARPS = 32, 128, 4
# the q|k|v form's launch (BLOCK_C = the head dim): 151 us at 8k tokens of the 0.8B shape, 170 at
# (32, 4), 185-390 at 64 rows or 8 warps (scripts/gpu/conv_tune.py, H200, 2026-12-01)
QKV_BLOCK_T, QKV_NUM_WARPS = 8, 2
L2_EPS = 1e-6  # fla's l2norm_fwd default, which the stages it replaces used

if triton is not None:

    @triton.jit
    def _conv_tile(X, WIN, CW, T, C, X_STRIDE, b, ts, cs, W: tl.constexpr):
        """silu(conv) of rows ts x channels cs of sequence b, fp32 [BLOCK_T, BLOCK_C]."""
        t_ok, c_ok = ts < T, cs < C
        x_base = X + b * T * X_STRIDE
        win = WIN + b * C * (W - 1)
        acc = tl.zeros([ts.shape[0], cs.shape[0]], tl.float32)
        for j in tl.static_range(W):
            src = ts + j - (W - 1)  # the input this tap reads: the chunk's, or the window's
            from_x = t_ok[:, None] & c_ok[None, :] & (src >= 0)[:, None]
            from_w = t_ok[:, None] & c_ok[None, :] & (src < 0)[:, None]
            xv = tl.load(x_base + src[:, None] * X_STRIDE + cs[None, :], mask=from_x, other=0.0)
            wv = tl.load(win + cs[None, :] * (W - 1) + (src + W - 1)[:, None], mask=from_w,
                         other=0.0)
            tap = tl.load(CW + cs * W + j, mask=c_ok, other=0.0)
            acc += (xv.to(tl.float32) + wv.to(tl.float32)) * tap[None, :]
        return acc / (1.0 + tl.exp(-acc))

    @triton.jit
    def _conv_prefill_kernel(X, WIN, CW, Y, T, C, X_STRIDE, W: tl.constexpr,
                             BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        b, pt, pc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        ts = pt * BLOCK_T + tl.arange(0, BLOCK_T)
        cs = pc * BLOCK_C + tl.arange(0, BLOCK_C)
        out = _conv_tile(X, WIN, CW, T, C, X_STRIDE, b, ts, cs, W)
        tl.store(Y + (b * T + ts[:, None]) * C + cs[None, :], out.to(Y.dtype.element_ty),
                 mask=(ts < T)[:, None] & (cs < C)[None, :])

    @triton.jit
    def _conv_qkv_kernel(X, WIN, CW, Y, T, C, X_STRIDE, NUM_ROWS, KEY_DIM, eps,
                         W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        """Channels [q KEY_DIM | k KEY_DIM | v] to three planes of Y: [NUM_ROWS, KEY_DIM] twice,
        then [NUM_ROWS, C - 2 KEY_DIM]; BLOCK_C = the head dim, so a q or k tile is one head:
        rounded to Y's dtype, then x / sqrt(sum x^2 + eps) in fp32 (fla's l2norm of that)."""
        b, pt, pc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        ts = pt * BLOCK_T + tl.arange(0, BLOCK_T)
        cs = pc * BLOCK_C + tl.arange(0, BLOCK_C)
        out = _conv_tile(X, WIN, CW, T, C, X_STRIDE, b, ts, cs, W).to(Y.dtype.element_ty)
        section = pc * BLOCK_C // KEY_DIM  # 0 q, 1 k, 2.. v
        section = tl.minimum(section, 2)
        if section < 2:
            xf = out.to(tl.float32)
            rstd = 1 / tl.sqrt(tl.sum(xf * xf, 1) + eps)
            out = (xf * rstd[:, None]).to(Y.dtype.element_ty)
        width = tl.where(section < 2, KEY_DIM, C - 2 * KEY_DIM)
        plane = Y + section.to(tl.int64) * NUM_ROWS * KEY_DIM
        cols = cs - section * KEY_DIM
        tl.store(plane + (b * T + ts[:, None]) * width + cols[None, :], out,
                 mask=(ts < T)[:, None] & (cs < C)[None, :])


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """x [B,T,C] with unit column stride and rows evenly spaced (a projection's view), else a copy."""
    bsz, seq_len, _ = x.shape
    if x.stride(-1) != 1 or x.stride(0) != seq_len * x.stride(1):
        x = x.contiguous()
    return x


def causal_conv1d_cuda(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor
                       ) -> torch.Tensor:
    """x [B,T,C] (unit column stride, any row stride); weight [C,W]; window [B,C,W-1] ->
    silu(conv(x)) [B,T,C] in x's dtype."""
    x = _rows_view(x)
    bsz, seq_len, channels = x.shape
    out = torch.empty(bsz, seq_len, channels, dtype=x.dtype, device=x.device)
    grid = (bsz, triton.cdiv(seq_len, BLOCK_T), triton.cdiv(channels, BLOCK_C))
    _conv_prefill_kernel[grid](x, window.contiguous(), weight.float().contiguous(), out, seq_len,
                               channels, x.stride(1), W=weight.shape[-1], BLOCK_T=BLOCK_T,
                               BLOCK_C=BLOCK_C, num_warps=NUM_WARPS)
    return out


def qkv_usable(key_dim: int, head_dim: int) -> bool:
    """The split-and-normalise form needs whole heads per tile: a power-of-two head dim that
    divides the key dim."""
    return head_dim & (head_dim - 1) == 0 and 16 <= head_dim <= 256 and key_dim % head_dim == 0


def causal_conv1d_qkv_cuda(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor,
                           key_dim: int, head_dim: int, block_t: int = QKV_BLOCK_T,
                           num_warps: int = QKV_NUM_WARPS
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B,T,C] as causal_conv1d_cuda, C = 2 key_dim + value_dim -> (l2norm(q) [B,T,key_dim],
    l2norm(k) [B,T,key_dim], v [B,T,value_dim]) of silu(conv(x)), each contiguous, norms per
    head_dim-wide head over the rounded conv output."""
    x = _rows_view(x)
    bsz, seq_len, channels = x.shape
    if not qkv_usable(key_dim, head_dim) or channels <= 2 * key_dim:
        raise ValueError(f"conv qkv split needs whole heads: key_dim={key_dim}, "
                         f"head_dim={head_dim}, channels={channels}")
    num_rows = bsz * seq_len
    buf = torch.empty(num_rows * channels, dtype=x.dtype, device=x.device)
    grid = (bsz, triton.cdiv(seq_len, block_t), triton.cdiv(channels, head_dim))
    _conv_qkv_kernel[grid](x, window.contiguous(), weight.float().contiguous(), buf, seq_len,
                           channels, x.stride(1), num_rows, key_dim, L2_EPS, W=weight.shape[-1],
                           BLOCK_T=block_t, BLOCK_C=head_dim, num_warps=num_warps)
    plane = num_rows * key_dim
    q = buf[:plane].view(bsz, seq_len, key_dim)
    k = buf[plane : 2 * plane].view(bsz, seq_len, key_dim)
    v = buf[2 * plane :].view(bsz, seq_len, channels - 2 * key_dim)
    return q, k, v
