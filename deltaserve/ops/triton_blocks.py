"""Decode GEMV on llama.cpp's K-quant and IQ4_XS blocks for CUDA GPUs (Triton), fp32 accumulation:
the file's bytes read as they are (quant/ggml_blocks.py is the layout and the reference). Q4_K and
Q6_K go to the word-wise kernels of ops/triton_kquants.py; Q5_K and IQ4_XS stay here.

One program computes BLOCK_N output rows of one input row and walks K one 256-weight block at a
time: per 32- (or 16-) weight sub-block a dot of the codes with x, times the sub-block's scale;
the K-quants' mins come off as dmin * m * sum(x) per sub-block, so no weight is ever rebuilt.
Weights arrive as uint8 [N, K / 256 * bytes] and as the same memory seen as int16 (the fp16 d /
dmin at even offsets). Contract: dequantize_blocks then F.linear (tests/ops/test_blocks.py).
"""

from __future__ import annotations

import torch

from deltaserve.ops import triton_kquants
from deltaserve.ops.backend import pdl_enabled, tl, triton
from deltaserve.ops.backend import triton_enabled as available  # noqa: F401 (callers ask here)
from deltaserve.quant.ggml_blocks import BLOCKS, IQ4_VALUES

KINDS = ("q4_k", "q5_k", "q6_k", "iq4_xs")
BLOCK_N = 16


def supports(scheme) -> bool:
    """The block layouts these kernels read (quant/linear's dispatch asks every Triton kernel)."""
    return scheme.kind in KINDS
_LUT: dict[torch.device, torch.Tensor] = {}

if triton is not None:

    @triton.jit
    def _f16_at(W16, at):
        """The fp16 at (even) byte offsets `at`, as fp32."""
        return tl.load(W16 + at // 2).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _k4_scales(W, at, j):
        """Q4_K / Q5_K six-bit (scale, min) of sub-blocks j [J] from the 12 bytes at `at` [BN]."""
        low = j < 4
        a = tl.load(W + at[:, None] + tl.where(low, j, j + 4)[None, :]).to(tl.int32)
        b = tl.load(W + at[:, None] + tl.where(low, j + 4, j - 4)[None, :]).to(tl.int32)
        c = tl.load(W + at[:, None] + j[None, :]).to(tl.int32)
        sc = tl.where(low[None, :], a & 63, (a & 15) | ((b >> 6) << 4))
        mn = tl.where(low[None, :], b & 63, (a >> 4) | ((c >> 6) << 4))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _k4_kernel(W, W16, X, Y, N, K, ROW_BYTES, BYTES: tl.constexpr, FIVE: tl.constexpr,
                   BLOCK_N: tl.constexpr):
        """Q4_K (FIVE=0: d, dmin, scales[12], qs[128]) and Q5_K (FIVE=1: qh[32] before qs)."""
        m = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = rows < N
        rows = tl.where(ok, rows, 0)
        c = tl.arange(0, 4)
        i = tl.arange(0, 32)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for blk in range(0, K // 256):
            base = rows.to(tl.int64) * ROW_BYTES + blk * BYTES
            d = _f16_at(W16, base)
            dmin = _f16_at(W16, base + 2)
            qs_at = 48 if FIVE else 16
            q = tl.load(W + base[:, None, None] + qs_at + c[None, :, None] * 32
                        + i[None, None, :]).to(tl.int32)
            lo = q & 15
            hi = q >> 4
            if FIVE:
                qh = tl.load(W + base[:, None, None] + 16 + i[None, None, :]).to(tl.int32)
                lo += ((qh >> (2 * c[None, :, None])) & 1) << 4
                hi += ((qh >> (2 * c[None, :, None] + 1)) & 1) << 4
            xb = X + m * K + blk * 256
            x_lo = tl.load(xb + c[:, None] * 64 + i[None, :]).to(tl.float32)
            x_hi = tl.load(xb + c[:, None] * 64 + 32 + i[None, :]).to(tl.float32)
            dot_lo = tl.sum(lo.to(tl.float32) * x_lo[None, :, :], axis=2)  # [BN, 4]
            dot_hi = tl.sum(hi.to(tl.float32) * x_hi[None, :, :], axis=2)
            sc_lo, mn_lo = _k4_scales(W, base + 4, 2 * c)
            sc_hi, mn_hi = _k4_scales(W, base + 4, 2 * c + 1)
            sum_lo = tl.sum(x_lo, axis=1)[None, :]
            sum_hi = tl.sum(x_hi, axis=1)[None, :]
            acc += d * tl.sum(sc_lo * dot_lo + sc_hi * dot_hi, axis=1)
            acc -= dmin * tl.sum(mn_lo * sum_lo + mn_hi * sum_hi, axis=1)
        tl.store(Y + m * N + rows, acc.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _iq4_xs_kernel(W, W16, X, Y, LUT, N, K, ROW_BYTES, BLOCK_N: tl.constexpr):
        """IQ4_XS: d, scales_h (u16), scales_l[4], qs[128] indices into the IQ4 codebook."""
        m = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = rows < N
        rows = tl.where(ok, rows, 0)
        ib = tl.arange(0, 8)
        j = tl.arange(0, 16)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for blk in range(0, K // 256):
            base = rows.to(tl.int64) * ROW_BYTES + blk * 136
            d = _f16_at(W16, base)
            q = tl.load(W + base[:, None, None] + 8 + 16 * ib[None, :, None]
                        + j[None, None, :]).to(tl.int32)
            lo = tl.load(LUT + (q & 15))
            hi = tl.load(LUT + (q >> 4))
            xb = X + m * K + blk * 256 + 32 * ib[:, None] + j[None, :]
            x_lo = tl.load(xb).to(tl.float32)[None]
            dot = tl.sum(lo * x_lo + hi * tl.load(xb + 16).to(tl.float32)[None], axis=2)  # [BN, 8]
            sh = tl.load(W16 + (base + 2) // 2).to(tl.int32) & 0xFFFF
            sl = tl.load(W + base[:, None] + 4 + ib[None, :] // 2).to(tl.int32)
            ls = ((sl >> (4 * (ib[None, :] % 2))) & 15) | (((sh[:, None] >> (2 * ib[None, :]))
                                                            & 3) << 4)
            acc += d * tl.sum((ls - 32).to(tl.float32) * dot, axis=1)
        tl.store(Y + m * N + rows, acc.to(Y.dtype.element_ty), mask=ok)


def gemv_blocks_cuda(x: torch.Tensor, w: torch.Tensor, kind: str) -> torch.Tensor:
    """x [M, K] (M small: one pass over the weight per row; fp32 or 16-bit, the math fp32), w uint8
    [N, K / 256 * bytes] of a kind in KINDS -> [M, N] in x's dtype (no cast kernels around the
    GEMV: on a 0.8B Q4_K_M decode step on an H100 those two copies per GEMV took 0.45 of 2.5 ms)."""
    if kind in triton_kquants.KINDS:  # the word-wise kernels, one row at a time
        mode = 2 if pdl_enabled() else 0
        return torch.cat([triton_kquants.gemv_kquant_cuda(x[r:r + 1], w, kind, pdl=mode)
                          for r in range(x.shape[0])]) if x.shape[0] > 1 else \
            triton_kquants.gemv_kquant_cuda(x, w, kind, pdl=mode)
    _, qk, nbytes, _ = BLOCKS[kind]
    rows, k = x.shape
    n = w.shape[0]
    if k % qk or w.shape[1] != k // qk * nbytes:
        raise ValueError(f"{kind} weight {tuple(w.shape)} does not hold {k} columns")
    x = x.contiguous()
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    w16 = w.view(torch.int16)  # every row's byte count is even: the fp16 fields stay aligned
    grid = (triton.cdiv(n, BLOCK_N), rows)
    if kind == "q5_k":
        _k4_kernel[grid](w, w16, x, y, n, k, w.shape[1], BYTES=nbytes, FIVE=True, BLOCK_N=BLOCK_N)
    elif kind == "iq4_xs":
        if x.device not in _LUT:
            _LUT[x.device] = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=x.device)
        _iq4_xs_kernel[grid](w, w16, x, y, _LUT[x.device], n, k, w.shape[1], BLOCK_N=BLOCK_N)
    else:
        raise ValueError(f"no Triton GEMV for {kind}")
    return y
