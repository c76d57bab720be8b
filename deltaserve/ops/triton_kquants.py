"""Decode GEMV on llama.cpp's Q4_K and Q6_K blocks for CUDA GPUs (Triton), read in machine words:
the file's bytes as they are (quant/ggml_blocks.py is the layout and the reference), launched
with PDL as ops/triton_qgemv's GEMVs are. The kernels can compute a GEMV prologue
(ops/gemv_prologue), but the engine does not ask them to: computed per strided x load it cost
more than the separate norm kernel (0.8B Q4_K_M on an H100: 695 tok/s fused, 833 not).

Measured on one H100, L2-cold (docs/benchmarks/2026-12-07-h100-aa91bc3-kquant-gemv-q4_k_m.json):
the Q6_K head [248320, 1024] 159 us at 1.31 TB/s (the byte-wise kernel: ~0.70 ms); Q4_K
6144 x 1024 5.2 us (the byte-wise 6.8), 1024 x 3584 7.4 us (16.2).

Q4_K (144 B = 36 words per 256 weights: d|dmin, three words of 6-bit scales and mins, 32 words of
codes). Word w of chunk c holds code bytes 4w..4w+3; byte t's low nibble is weight 64c + 4w + t
(sub-block 2c), its high nibble weight 64c + 32 + 4w + t (sub-block 2c + 1). Each word's eight
nibbles become 0.5 + n / 32 in one byte permute each (triton_qgemv's MAGIC 4) and meet x by a
strided load from L1; per sub-block sum(n x) = 32 (dot - sum(x) / 2), and the mins come off as
dmin * m * sum(x): no weight is rebuilt.

Q6_K (210 B per 256 weights, so blocks sit on 2-byte boundaries only): codes read as 16-bit
halves; half u of ql / qh holds weights l = 2u, 2u + 1 of each 32-run. The 16 int8 scales apply
per 16 weights: the dot is reduced over each 8-half run before its scale, so scales are loaded
once per sub-block, not once per weight.

The references: quant/ggml_blocks.dequantize_blocks then F.linear (tests/ops/test_blocks.py).
"""

from __future__ import annotations

import torch

from deltaserve.ops import gemv_prologue, tuning
from deltaserve.ops.backend import pdl_launch, pdl_supported, tl, triton

KINDS = ("q4_k", "q6_k")
BITS = {"q4_k": 4, "q6_k": 6}
# (BLOCK_N rows, NB blocks of 256 per K-step, num_warps): TUNED per (bits, K, N window), measured
# L2-cold by scripts/gpu/kquant_bench.py (ops/tuning/gpu-triton-kquants.json); other shapes
# take DEFAULT_CONFIG.
Config = tuple[int, int, int]
DEFAULT_CONFIG: dict[str, Config] = {"q4_k": (8, 4, 4), "q6_k": (8, 4, 4)}
TUNED: dict[tuple[int, int, int, int], Config] = tuning.table("gpu-triton-kquants")


def config_for(kind: str, n: int, k: int) -> Config:
    for (bits, kk, lo, hi), cfg in TUNED.items():
        if bits == BITS[kind] and kk == k and lo <= n < hi:
            return cfg
    return DEFAULT_CONFIG[kind]

if triton is not None:
    from deltaserve.ops.backend import gdc_launch_dependents, gdc_wait
    from deltaserve.ops.gemv_prologue import rstd_of, x_at
    from deltaserve.ops.triton_qgemv import _nibbles_half

    @triton.jit
    def _k4_load(W, rows, row_ok, blk, NBLK, ROW_Q):
        """One K-step's words of Q4_K blocks blk [NB]: codes [BN, NB, 4, 8], header [BN, NB] x 4.
        ROW_Q: a row's length in 16-byte units (so the compiler sees 16-byte aligned rows)."""
        ok = row_ok[:, None] & (blk < NBLK)[None, :]
        base = rows[:, None].to(tl.int64) * ROW_Q * 4 + blk[None, :] * 36  # [BN, NB] words
        c = tl.arange(0, 4)[None, None, :, None]
        w = tl.arange(0, 8)[None, None, None, :]
        q = tl.load(W + base[:, :, None, None] + 4 + c * 8 + w, mask=ok[:, :, None, None],
                    other=0)
        hdr = tl.load(W + base, mask=ok, other=0)
        s0 = tl.load(W + base + 1, mask=ok, other=0)
        s1 = tl.load(W + base + 2, mask=ok, other=0)
        s2 = tl.load(W + base + 3, mask=ok, other=0)
        return q, hdr, s0, s1, s2

    @triton.jit
    def _k4_scales(s0, s1, s2, h: tl.constexpr):
        """(scale, min) [BN, NB, 4] of sub-blocks 2c + h, c = 0..3, from the 12 scale bytes."""
        c = tl.arange(0, 4)[None, None, :]
        t8 = ((2 * c + h) % 4) * 8
        b0 = (s0[:, :, None] >> t8) & 255
        b1 = (s1[:, :, None] >> t8) & 255
        b2 = (s2[:, :, None] >> t8) & 255
        hi = c >= 2
        sc = tl.where(hi, (b2 & 15) | ((b0 >> 6) << 4), b0 & 63)
        mn = tl.where(hi, (b2 >> 4) | ((b1 >> 6) << 4), b1 & 63)
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _k4_step(acc, q, hdr, s0, s1, s2, X, R, NW, rstd, offset, blk, K,
                 XMODE: tl.constexpr, MAGIC: tl.constexpr):
        """acc [BN, NB] += the K-step's Q4_K dots (module docstring)."""
        c = tl.arange(0, 4)[None, :, None]
        w = tl.arange(0, 8)[None, None, :]
        xoff = blk[:, None, None] * 256 + c * 64 + w * 4  # [NB, 4, 8]
        x_ok = xoff < K
        p0 = tl.zeros(q.shape, dtype=tl.float32)
        p1 = tl.zeros(q.shape, dtype=tl.float32)
        sx0 = tl.zeros(xoff.shape, dtype=tl.float32)
        sx1 = tl.zeros(xoff.shape, dtype=tl.float32)
        if MAGIC:
            nib = _nibbles_half(q)  # nib[2t + h]: byte t, low (h 0) or high (h 1) nibble
        for t in tl.static_range(4):
            x0 = x_at(X, R, NW, xoff + t, x_ok, K, rstd, offset, XMODE)
            x1 = x_at(X, R, NW, xoff + 32 + t, x_ok, K, rstd, offset, XMODE)
            sx0 += x0
            sx1 += x1
            if MAGIC:
                p0 += nib[2 * t] * x0[None]
                p1 += nib[2 * t + 1] * x1[None]
            else:  # 0.5 + n / 32 exactly as the byte permute builds it
                p0 += (0.5 + ((q >> (8 * t)) & 15).to(tl.float32) / 32.0) * x0[None]
                p1 += (0.5 + ((q >> (8 * t + 4)) & 15).to(tl.float32) / 32.0) * x1[None]
        sx0 = tl.sum(sx0, axis=2)[None]  # [1, NB, 4]
        sx1 = tl.sum(sx1, axis=2)[None]
        dot0 = (tl.sum(p0, axis=3) - 0.5 * sx0) * 32.0  # sum(n x) per sub-block [BN, NB, 4]
        dot1 = (tl.sum(p1, axis=3) - 0.5 * sx1) * 32.0
        sc0, mn0 = _k4_scales(s0, s1, s2, 0)
        sc1, mn1 = _k4_scales(s0, s1, s2, 1)
        d = (hdr & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (hdr >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        acc += d * tl.sum(sc0 * dot0 + sc1 * dot1, axis=2)
        acc -= dmin * tl.sum(mn0 * sx0 + mn1 * sx1, axis=2)
        return acc

    @triton.jit
    def _k4_kernel(W, X, Y, N, K, R, NW, TOTAL, eps, offset, ROW_Q, BLOCK_N: tl.constexpr,
                   NB: tl.constexpr, MAGIC: tl.constexpr, PDL: tl.constexpr,
                   XMODE: tl.constexpr, NORM_BLOCK: tl.constexpr, ONE_STEP: tl.constexpr):
        """One program: BLOCK_N rows, K in steps of NB blocks. PDL as triton_qgemv's (1: wait
        first; 2: the first step's words loaded before the wait)."""
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        rows = tl.where(row_ok, rows, 0)
        nblk = K // 256
        acc = tl.zeros([BLOCK_N, NB], dtype=tl.float32)
        blk0 = tl.arange(0, NB)
        if PDL >= 2:
            q, hdr, s0, s1, s2 = _k4_load(W, rows, row_ok, blk0, nblk, ROW_Q)
        if PDL != 0:
            gdc_wait()
            gdc_launch_dependents()
        rstd = rstd_of(X, R, K, eps, TOTAL, pid, XMODE, NORM_BLOCK)
        start = 0
        if PDL >= 2:
            acc = _k4_step(acc, q, hdr, s0, s1, s2, X, R, NW, rstd, offset, blk0, K, XMODE, MAGIC)
            start = NB
        if not ONE_STEP or PDL < 2:
            for b in range(start, nblk, NB):
                blk = b + blk0
                q, hdr, s0, s1, s2 = _k4_load(W, rows, row_ok, blk, nblk, ROW_Q)
                acc = _k4_step(acc, q, hdr, s0, s1, s2, X, R, NW, rstd, offset, blk, K, XMODE,
                               MAGIC)
        tl.store(Y + rows, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _q6_load(W, rows, row_ok, blk, NBLK, ROW_H):
        """One K-step's Q6_K halves for blocks blk [NB]: ql low / high 32-runs [BN, NB, 2, 2, 8]
        (axes: 128-half h, u // 8, u % 8), qh [same], d [BN, NB]."""
        ok = row_ok[:, None] & (blk < NBLK)[None, :]
        base = rows[:, None].to(tl.int64) * ROW_H + blk[None, :] * 105  # [BN, NB] halves
        h = tl.arange(0, 2)[None, None, :, None, None]
        u = 8 * tl.arange(0, 2)[None, None, None, :, None] + tl.arange(0, 8)[None, None, None,
                                                                              None, :]
        b5 = base[:, :, None, None, None]
        ok5 = ok[:, :, None, None, None]
        qa = tl.load(W + b5 + 32 * h + u, mask=ok5, other=0).to(tl.int32)
        qb = tl.load(W + b5 + 32 * h + 16 + u, mask=ok5, other=0).to(tl.int32)
        qh = tl.load(W + b5 + 64 + 16 * h + u, mask=ok5, other=0).to(tl.int32)
        d = tl.load(W + base + 104, mask=ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        return qa, qb, qh, d

    @triton.jit
    def _q6_step(acc, qa, qb, qh, d, W8, rows, row_ok, blk, NBLK, ROW_B, X, R, NW, rstd, offset,
                 K, XMODE: tl.constexpr):
        """acc [BN, NB] += the K-step's Q6_K dots: code k of weight 128h + 32k + l (l = 2u + e)
        is nibble k // 2 of ql run k % 2 with bits 2k.. of qh, scale 8h + 2k + u // 8."""
        h = tl.arange(0, 2)[None, :, None, None]
        u = 8 * tl.arange(0, 2)[None, None, :, None] + tl.arange(0, 8)[None, None, None, :]
        xoff = blk[:, None, None, None] * 256 + 128 * h + 2 * u  # [NB, 2, 2, 8]
        x_ok = xoff < K
        ok = (row_ok[:, None] & (blk < NBLK)[None, :])[:, :, None, None]
        s_at = (rows[:, None].to(tl.int64) * ROW_B + blk[None, :] * 210)[:, :, None, None] + 192 \
            + 8 * tl.arange(0, 2)[None, None, :, None] + tl.arange(0, 2)[None, None, None, :]
        for k in tl.static_range(4):
            part = tl.zeros(qa.shape, dtype=tl.float32)
            for e in tl.static_range(2):
                if k % 2 == 0:
                    lo = qa >> (8 * e)
                else:
                    lo = qb >> (8 * e)
                nib = (lo >> (4 * (k // 2))) & 15
                code = nib | (((qh >> (8 * e + 2 * k)) & 3) << 4)
                xe = x_at(X, R, NW, xoff + 32 * k + e, x_ok, K, rstd, offset, XMODE)
                part += (code - 32).to(tl.float32) * xe[None]
            sc = tl.load(W8 + s_at + 2 * k, mask=ok, other=0).to(tl.int8, bitcast=True)
            acc += d * tl.sum(tl.sum(tl.sum(part, axis=4) * sc.to(tl.float32), axis=3), axis=2)
        return acc

    @triton.jit
    def _q6_kernel(W, W8, X, Y, N, K, R, NW, TOTAL, eps, offset, ROW_H, BLOCK_N: tl.constexpr,
                   NB: tl.constexpr, PDL: tl.constexpr, XMODE: tl.constexpr,
                   NORM_BLOCK: tl.constexpr, ONE_STEP: tl.constexpr):
        """As _k4_kernel, for Q6_K (W: the row bytes as int16 halves, W8: as bytes)."""
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        rows = tl.where(row_ok, rows, 0)
        nblk = K // 256
        acc = tl.zeros([BLOCK_N, NB], dtype=tl.float32)
        blk0 = tl.arange(0, NB)
        if PDL >= 2:
            qa, qb, qh, d = _q6_load(W, rows, row_ok, blk0, nblk, ROW_H)
        if PDL != 0:
            gdc_wait()
            gdc_launch_dependents()
        rstd = rstd_of(X, R, K, eps, TOTAL, pid, XMODE, NORM_BLOCK)
        start = 0
        if PDL >= 2:
            acc = _q6_step(acc, qa, qb, qh, d, W8, rows, row_ok, blk0, nblk, 2 * ROW_H, X, R, NW,
                           rstd, offset, K, XMODE)
            start = NB
        if not ONE_STEP or PDL < 2:
            for b in range(start, nblk, NB):
                blk = b + blk0
                qa, qb, qh, d = _q6_load(W, rows, row_ok, blk, nblk, ROW_H)
                acc = _q6_step(acc, qa, qb, qh, d, W8, rows, row_ok, blk, nblk, 2 * ROW_H, X, R,
                               NW, rstd, offset, K, XMODE)
        tl.store(Y + rows, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=row_ok)


def gemv_kquant_cuda(x: torch.Tensor, w: torch.Tensor, kind: str, config: Config | None = None,
                     pdl: int = 0, prologue: gemv_prologue.Prologue | None = None,
                     magic: bool = True) -> torch.Tensor:
    """x [1, K] (fp32 or 16-bit; the math fp32), w uint8 [N, K / 256 * bytes] of kind q4_k or q6_k
    -> [1, N] in x's dtype. prologue: the GEMV reads rms_norm(residual + x) or silu(gate) * up of
    x instead (ops/gemv_prologue). pdl: 0 off, 1 wait first, 2 the first step's weights before
    the wait (Hopper; ignored where unsupported). magic False: plain nibble conversion (Triton's
    interpreter has no inline PTX)."""
    n, k = w.shape[0], gemv_prologue.gemv_cols(x, prologue)
    block_n, nb, warps = config or config_for(kind, n, k)
    gemv_prologue.check(x, prologue, k)
    nbytes = 144 if kind == "q4_k" else 210
    if x.shape[0] != 1 or k % 256 or w.shape[1] != k // 256 * nbytes:
        raise ValueError(f"{kind} GEMV: x {list(x.shape)} against weight {tuple(w.shape)}")
    x = x.contiguous()
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    mode = pdl if pdl and pdl_supported() else 0
    one_step = mode >= 2 and nb * 256 >= k
    common = dict(BLOCK_N=block_n, NB=nb, PDL=mode, ONE_STEP=one_step, num_warps=warps,
                  **gemv_prologue.kernel_args(x, prologue), **pdl_launch(bool(mode)))
    grid = (triton.cdiv(n, block_n),)
    if kind == "q4_k":
        _k4_kernel[grid](w.view(torch.int32), x, y, n, k, ROW_Q=w.shape[1] // 16, MAGIC=magic,
                         **common)
    elif kind == "q6_k":
        _q6_kernel[grid](w.view(torch.int16), w, x, y, n, k, ROW_H=w.shape[1] // 2, **common)
    else:
        raise ValueError(f"no word-wise Triton GEMV for {kind}")
    return y
