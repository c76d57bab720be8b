"""Decode GEMV on packed int8 / 4-bit affine weights for CUDA GPUs (Triton), fp32 accumulation.

One program computes BLOCK_N output rows and walks K in steps of BLOCK_K columns (BLOCK_K / G
quantization groups per step): per group a dot of codes and x, times the row's group scale, plus
bias times the group's sum of x. int4 words (8 codes, low bits first) are never reshaped: the j-th
nibble of every word meets x at positions 8*i + j, a strided load of x from L1.

The reference is ops/qgemv.qgemv_ref (dequantize, then F.linear). The launch configuration per
shape comes from TUNED, written from scripts/gpu/qgemv_tune.py's H200 run (see that table).
Measured there: int8 codes convert faster by the 2**23 mantissa trick (MAGIC) than by int-to-float;
int4 codes do not (its bound is the integer shift/mask work, not the conversion).
"""

from __future__ import annotations

import torch

from deltaserve.ops.backend import tl, triton
from deltaserve.ops.backend import triton_enabled as available  # noqa: F401 (callers ask here)

if triton is not None:

    @triton.jit
    def _to_float(q, BITS: tl.constexpr, MAGIC: tl.constexpr):
        """Codes to fp32. MAGIC: put the code into the mantissa of 2**23 and subtract, two full-rate
        ops instead of an int-to-float conversion (a quarter-rate unit on recent GPUs)."""
        if MAGIC:
            if BITS == 8:  # int8 q: 0x4B000080 + q is 2**23 + 128 + q as fp32 bits, exactly
                out = (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
            else:  # q in [0, 15]
                out = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        else:
            out = q.to(tl.float32)
        return out

    @triton.jit
    def _gemv_kernel(W, S, B, X, Y, YI, N, K, G: tl.constexpr, BITS: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     MAGIC: tl.constexpr, ARGMAX: tl.constexpr):
        NG: tl.constexpr = BLOCK_K // G
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        num_groups = K // G
        acc = tl.zeros([BLOCK_N, NG], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            gidx = k0 // G + tl.arange(0, NG)
            g_ok = row_ok[:, None] & (gidx < num_groups)[None, :]
            g_off = rows[:, None] * num_groups + gidx[None, :]
            if BITS == 8:
                cols = k0 + tl.arange(0, BLOCK_K)
                q = tl.load(W + rows[:, None] * K + cols[None, :],
                            mask=row_ok[:, None] & (cols < K)[None, :], other=0)
                x = tl.load(X + cols, mask=cols < K, other=0.0).to(tl.float32)
                part = tl.sum(tl.reshape(_to_float(q, 8, MAGIC) * x[None, :], (BLOCK_N, NG, G)), axis=2)
            else:
                wcols = k0 // 8 + tl.arange(0, BLOCK_K // 8)
                w_ok = wcols * 8 < K
                words = tl.load(W + rows[:, None] * (K // 8) + wcols[None, :],
                                mask=row_ok[:, None] & w_ok[None, :], other=0)
                prod = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
                for j in tl.static_range(8):
                    xj = tl.load(X + wcols * 8 + j, mask=w_ok, other=0.0).to(tl.float32)
                    prod += _to_float((words >> (4 * j)) & 0xF, 4, MAGIC) * xj[None, :]
                part = tl.sum(tl.reshape(prod, (BLOCK_N, NG, G // 8)), axis=2)
            acc += part * tl.load(S + g_off, mask=g_ok, other=0.0)
            if HAS_BIAS:
                cols = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(X + cols, mask=cols < K, other=0.0).to(tl.float32)
                xsum = tl.sum(tl.reshape(x, (NG, G)), axis=1)
                acc += tl.load(B + g_off, mask=g_ok, other=0.0) * xsum[None, :]
        y = tl.sum(acc, axis=1)
        if ARGMAX:  # the greedy head: this block's maximum and its row, not the logits
            y = tl.where(row_ok, y, float("-inf"))
            tl.store(Y + pid, tl.max(y, 0))
            tl.store(YI + pid, pid * BLOCK_N + tl.argmax(y, 0, tie_break_left=True))
        else:
            tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


# (bits, K, N window [lo, hi)) -> (BLOCK_N, BLOCK_K, num_warps, num_stages, magic): the best
# L2-cold config per Qwen3.5-0.8B decode shape from `python scripts/gpu/qgemv_tune.py` on one H200,
# 2026-11-29 (docs/benchmarks/2026-11-29-h200-qgemv-tune.json; every entry beat bf16 cuBLAS on the
# same shape). Shapes outside every window take DEFAULT, the best config on the 6144x1024 shape.
Config = tuple[int, int, int, int, int]
_BIG = 1 << 40
TUNED: dict[tuple[int, int, int, int], Config] = {
    (8, 1024, 0, 3072): (4, 1024, 4, 1, 1),  # 2048 rows: 2.75 us
    (8, 1024, 3072, 5120): (8, 512, 8, 1, 1),  # 4096: 3.54 us
    (8, 1024, 5120, 16384): (8, 512, 4, 1, 1),  # 6144 / 7168: 4.20 / 4.61 us
    (8, 1024, 16384, _BIG): (16, 512, 1, 1, 1),  # vocabulary head 248320: 69.8 us, 94% of copy
    (8, 2048, 0, _BIG): (2, 1024, 8, 1, 1),  # 1024 rows: 3.17 us
    (8, 3584, 0, _BIG): (2, 1024, 8, 1, 1),  # 1024 rows: 4.53 us
    (4, 1024, 0, 16384): (8, 1024, 4, 1, 0),  # 2048..7168 rows: 3.27..4.92 us
    (4, 1024, 16384, _BIG): (32, 512, 2, 1, 0),  # vocabulary head: 67.4 us, 57% of copy
    (4, 2048, 0, _BIG): (4, 1024, 4, 1, 0),  # 4.37 us
    (4, 3584, 0, _BIG): (4, 1024, 4, 1, 0),  # 6.78 us
}
DEFAULT: dict[int, Config] = {8: (8, 512, 4, 1, 1), 4: (8, 1024, 4, 1, 0)}


def config_for(bits: int, n: int, k: int) -> Config:
    for (b, kk, lo, hi), cfg in TUNED.items():
        if b == bits and kk == k and lo <= n < hi:
            return cfg
    return DEFAULT[bits]


def qgemv_cuda(x: torch.Tensor, p: dict, scheme,
               config: Config | None = None) -> torch.Tensor:
    """x [1, K] on CUDA (fp32 or 16-bit; the math is fp32), packed int8 or 4-bit affine weights
    -> [1, N] in x's dtype (no cast kernels around the GEMV)."""
    w = p["weight"].view(torch.int32) if scheme.kind == "affine" else p["weight"]
    n = w.shape[0]
    config = config or config_for(scheme.bits, n, x.shape[-1])
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _launch(x, p, scheme, w, y, y, config, False)
    return y


def qgemv_argmax_cuda(x: torch.Tensor, p: dict, scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMV with the greedy head's epilogue: x [1, K] -> per block of BLOCK_N rows the largest
    logit and its row (first on ties), ([1, blocks] fp32, [1, blocks] int32)."""
    w = p["weight"].view(torch.int32) if scheme.kind == "affine" else p["weight"]
    config = config_for(scheme.bits, w.shape[0], x.shape[-1])
    blocks = triton.cdiv(w.shape[0], config[0])
    vals = torch.empty(1, blocks, dtype=torch.float32, device=x.device)
    idx = torch.empty(1, blocks, dtype=torch.int32, device=x.device)
    _launch(x, p, scheme, w, vals, idx, config, True)
    return vals, idx


def _launch(x, p: dict, scheme, w: torch.Tensor, y: torch.Tensor, yi: torch.Tensor,
            config: Config, argmax: bool) -> None:
    block_n, block_k, warps, stages, magic = config
    block_k = max(block_k, scheme.group_size)
    n, k = w.shape[0], x.shape[-1]
    biases = p.get("biases", p["scales"])
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        w, p["scales"], biases, x.contiguous(), y, yi, n, k, G=scheme.group_size,
        BITS=scheme.bits, HAS_BIAS=scheme.has_biases(), BLOCK_N=block_n, BLOCK_K=block_k,
        MAGIC=magic, ARGMAX=argmax, num_warps=warps, num_stages=stages)
