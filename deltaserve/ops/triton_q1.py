"""Decode GEMV on 1-bit (q1) weights with int8 activations for CUDA GPUs (Triton): bit planes and
popcounts, no work per weight.

The exact q1 GEMV (ops/triton_qgemv) flips the sign of x per weight and sums 32 floats per word;
Triton spreads those 32 over the lanes of a warp, so its sums are shuffles, and a 27B decode step
ran at ~170 GB/s of packed bits (5.8% of an H100's copy rate). Here x is rounded per 32 to int8,
as the CPU's int8-activation q1 kernels and llama.cpp's Q1_0 x Q8_0 do (ops/qgemv.qgemv_act_ref is
the spec), and split into its eight two's-complement bit planes, one 32-bit word per plane per 32
inputs. A weight word b (bit j = code 2 b_j - 1 of input j) then meets its 32 inputs as

    sum_j b_j xq_j = sum_p c_p popc(b & plane_p),   c_p = 2**p (p < 7), c_7 = -128
    w . x = dx * (2 sum_j b_j xq_j - sum_j xq_j)

eight AND / POPC / shift-add triples per 32 weights, all integer, all within a thread.

Two kernels: `_act_kernel` computes the planes, sum(xq) and dx of x once per GEMV (it also runs the
GEMV prologue, ops/gemv_prologue: x may be rms_norm(residual + x) or silu(gate) * up), and
`_gemv_kernel` reads them beside the weight words, BLOCK_N rows per program.
"""

from __future__ import annotations

import os

import torch

from deltaserve.ops import gemv_prologue
from deltaserve.ops.backend import pdl_enabled, pdl_launch, tl, triton
from deltaserve.ops.backend import triton_enabled as available  # noqa: F401 (callers ask here)

# Triton's interpreter (TRITON_INTERPRET=1, the CPU test runs) has no popc: it counts by SWAR sums
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
PLANES = 8  # int8 two's complement
ROWS = PLANES + 2  # the activation buffer's rows: the planes, sum(xq), dx (fp32 bits)

if triton is not None:
    from triton.language.extra import libdevice

    from deltaserve.ops.backend import gdc_launch_dependents, gdc_wait
    from deltaserve.ops.gemv_prologue import rstd_of, x_at

    @triton.jit
    def _popc(v, INTERPRET: tl.constexpr):
        if INTERPRET:
            v = v.to(tl.uint32, bitcast=True)
            v = v - ((v >> 1) & 0x55555555)
            v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
            v = (v + (v >> 4)) & 0x0F0F0F0F
            out = (((v * 0x01010101) >> 24) & 0xFF).to(tl.int32)
        else:
            out = libdevice.popc(v)
        return out

    @triton.jit
    def _div(a, b, INTERPRET: tl.constexpr):
        """a / b rounded to nearest as torch divides (Triton's `/` on fp32 is approximate)."""
        if INTERPRET:
            out = a / b
        else:
            out = libdevice.div_rn(a, b)
        return out

    @triton.jit
    def _act_kernel(X, R, NW, TOTAL, eps, offset, A, K, XMODE: tl.constexpr,
                    NORM_BLOCK: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr,
                    INTERPRET: tl.constexpr):
        """x (after the prologue) -> A int32 [ROWS, K / 32]: per 32 inputs the eight bit planes of
        xq = rint(x / dx) (dx = absmax / 127, 0 for a zero group), sum(xq), and dx's bits."""
        PLANES: tl.constexpr = 8
        pid = tl.program_id(0)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        nw = K // 32
        rstd = rstd_of(X, R, K, eps, TOTAL, pid, XMODE, NORM_BLOCK)
        words = pid * BLOCK_W + tl.arange(0, BLOCK_W)
        w_ok = words < nw
        cols = words[:, None] * 32 + tl.arange(0, 32)[None, :]
        x = x_at(X, R, NW, cols, w_ok[:, None], K, rstd, offset, XMODE)
        d = _div(tl.max(tl.abs(x), axis=1), 127.0, INTERPRET)
        safe = tl.where(d > 0, d, 1.0)
        # round half to even as torch.round: 1.5 * 2**23 added and taken off (|x / d| <= 127)
        xq = (_div(x, safe[:, None], INTERPRET) + 12582912.0) - 12582912.0
        xq = tl.minimum(tl.maximum(tl.where(d[:, None] > 0, xq, 0.0), -127.0), 127.0).to(tl.int32)
        bit = tl.arange(0, 32)[None, :]
        for p in tl.static_range(PLANES):  # distinct bits: the sum is their OR
            plane = tl.sum(((xq >> p) & 1) << bit, axis=1)
            tl.store(A + p * nw + words, plane, mask=w_ok)
        tl.store(A + PLANES * nw + words, tl.sum(xq, axis=1), mask=w_ok)
        tl.store(A + (PLANES + 1) * nw + words, d.to(tl.int32, bitcast=True), mask=w_ok)

    @triton.jit
    def _gemv_kernel(W, S, A, Y, N, K, G: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_W: tl.constexpr, PDL: tl.constexpr, INTERPRET: tl.constexpr):
        """Y [N] = the q1 rows W (int32 words [N, K / 32]) times the activation A, per group of G
        inputs times the row's scale S [N, K / G]."""
        PLANES: tl.constexpr = 8  # as the module's PLANES (a jit function reads no plain global)
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        nw = K // 32
        WG: tl.constexpr = G // 32
        NG: tl.constexpr = BLOCK_W // WG
        acc = tl.zeros([BLOCK_N, NG], dtype=tl.float32)
        if PDL:  # the weights are static: the first words load before the wait
            gdc_wait()
            gdc_launch_dependents()
        for w0 in range(0, nw, BLOCK_W):
            words = w0 + tl.arange(0, BLOCK_W)
            w_ok = words < nw
            q = tl.load(W + rows[:, None] * nw + words[None, :],
                        mask=row_ok[:, None] & w_ok[None, :], other=0)
            dot = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int32)
            for p in tl.static_range(PLANES):
                plane = tl.load(A + p * nw + words, mask=w_ok, other=0)
                c = _popc(q & plane[None, :], INTERPRET)
                if p == PLANES - 1:
                    dot -= c << p
                else:
                    dot += c << p
            sq = tl.load(A + PLANES * nw + words, mask=w_ok, other=0)
            dx = tl.load(A + (PLANES + 1) * nw + words, mask=w_ok, other=0).to(tl.float32,
                                                                               bitcast=True)
            v = (2 * dot - sq[None, :]).to(tl.float32) * dx[None, :]
            gsum = tl.sum(tl.reshape(v, (BLOCK_N, NG, WG)), axis=2)
            groups = w0 // WG + tl.arange(0, NG)
            s = tl.load(S + rows[:, None] * (nw // WG) + groups[None, :],
                        mask=row_ok[:, None] & (groups < nw // WG)[None, :], other=0.0)
            acc += gsum * s.to(tl.float32)
        tl.store(Y + rows, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=row_ok)


# (BLOCK_N, BLOCK_W, num_warps): the launch shape; words per step cover whole groups
Config = tuple[int, int, int]
DEFAULT: Config = (16, 32, 4)
ACT_WORDS = 32  # words per program of the activation kernel


def supports(scheme) -> bool:
    """q1 in power-of-two groups of whole words, at least one word."""
    g = scheme.group_size
    return scheme.kind == "q1" and g % 32 == 0 and g & (g - 1) == 0


def act_cuda(x: torch.Tensor, k: int, prologue=None, pdl: bool = False) -> torch.Tensor:
    """x [1, K'] (its prologue applied) -> the activation buffer int32 [ROWS, K / 32]."""
    a = torch.empty(ROWS, k // 32, dtype=torch.int32, device=x.device)
    _act_kernel[(triton.cdiv(k // 32, ACT_WORDS),)](
        x, **gemv_prologue.kernel_args(x, prologue), A=a, K=k, BLOCK_W=ACT_WORDS, PDL=pdl,
        INTERPRET=_INTERPRET, num_warps=4, **pdl_launch(pdl))
    return a


def q1_gemv_a8_cuda(x: torch.Tensor, p: dict, scheme, config: Config | None = None,
                    prologue=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] (fp32 or 16-bit) times the q1 weight p (uint8 bits [N, K / 8], scales [N, K / G])
    with x rounded per 32 to int8 -> [1, N] in x's dtype (ops/qgemv.qgemv_act_ref's math)."""
    w = p["weight"]
    if not w.is_contiguous():
        raise ValueError("q1_gemv_a8_cuda: packed weights must be contiguous")
    n, k = w.shape[0], gemv_prologue.gemv_cols(x, prologue)
    if p["scales"].shape[-1] * scheme.group_size != k or k % 32:
        raise ValueError(f"q1_gemv_a8_cuda: x gives {k} inputs, the packed weight has "
                         f"{p['scales'].shape[-1] * scheme.group_size}")
    gemv_prologue.check(x, prologue, k)
    pdl = pdl_enabled()
    a = act_cuda(x.contiguous(), k, prologue, pdl)
    block_n, block_w, warps = config or DEFAULT
    block_w = max(block_w, scheme.group_size // 32)
    y = out if out is not None else torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        w.view(torch.int32), p["scales"], a, y, n, k, G=scheme.group_size, BLOCK_N=block_n,
        BLOCK_W=block_w, PDL=pdl, INTERPRET=_INTERPRET, num_warps=warps, **pdl_launch(pdl))
    return y
