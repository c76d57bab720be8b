"""Decode GEMV on packed int8 / 4-bit affine weights for CUDA GPUs (Triton), fp32 accumulation.

One program computes BLOCK_N output rows, one quantization group per step: a dot of codes and x,
times the row's group scale, plus bias times the group's sum of x. The reference is
ops/qgemv.qgemv_ref (dequantize, then F.linear); scripts/gpu/qgemv_bench.py checks and times it.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _gemv_kernel(W, S, B, X, Y, N, K, G: tl.constexpr, BITS: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        num_groups = K // G
        for k0 in range(0, K, G):  # one group per step: one scale (and bias) per row
            cols = k0 + tl.arange(0, G)
            ok = row_ok[:, None] & (cols[None, :] < K)
            if BITS == 8:
                q = tl.load(W + rows[:, None] * K + cols[None, :], mask=ok, other=0).to(tl.float32)
            else:  # 4-bit codes, 8 per int32 word, low bits first: load each word once, expand
                wcols = k0 // 8 + tl.arange(0, G // 8)
                words = tl.load(W + rows[:, None] * (K // 8) + wcols[None, :],
                                mask=row_ok[:, None], other=0)
                shifts = tl.arange(0, 8) * 4
                q = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_N, G))
                q = q.to(tl.float32)
            x = tl.load(X + cols, mask=cols < K, other=0.0)
            g = rows * num_groups + k0 // G
            acc += tl.sum(q * x[None, :], axis=1) * tl.load(S + g, mask=row_ok, other=0.0)
            if HAS_BIAS:
                acc += tl.load(B + g, mask=row_ok, other=0.0) * tl.sum(x, axis=0)
        tl.store(Y + rows, acc, mask=row_ok)


def qgemv_cuda(x: torch.Tensor, p: dict, scheme, block_n: int = 32, block_k: int = 0) -> torch.Tensor:
    """x [1, K] fp32 on CUDA, packed int8 or 4-bit affine weights -> [1, N] fp32."""
    w = p["weight"]
    if scheme.kind == "affine":
        w = w.view(torch.int32)
    n = w.shape[0]
    k = x.shape[-1]
    y = torch.empty(1, n, dtype=torch.float32, device=x.device)
    biases = p.get("biases", p["scales"])
    grid = (triton.cdiv(n, block_n),)
    _gemv_kernel[grid](w, p["scales"], biases, x.contiguous(), y, n, k, G=scheme.group_size,
                       BITS=scheme.bits, HAS_BIAS=scheme.has_biases(), BLOCK_N=block_n,
                       BLOCK_K=block_k)
    return y
