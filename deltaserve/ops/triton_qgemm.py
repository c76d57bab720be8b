"""Decode-batch GEMM on packed int8 weights for CUDA GPUs (Triton): y = x W^T with W dequantized
tile by tile in registers (codes x group scale, rounded to the activation dtype, as the reference
dequantizes the whole weight) and fed to tensor-core dots; each weight byte is read once per step
for all rows, where dequantize-then-GEMM would write and re-read a 16-bit copy of every weight.

Contract: F.linear(x, dequantize(p, scheme, x.dtype)) (tests/ops/test_triton_qgemm.py). Shapes:
x [M, K] (M <= MAX_ROWS: a decode batch), codes [N, K] int8, scales [N, K/G] fp32.
"""

from __future__ import annotations

import torch

from deltaserve.ops.backend import tl, triton
from deltaserve.ops.backend import triton_enabled as available  # noqa: F401 (callers ask here)

MAX_ROWS = 256

if triton is not None:

    @triton.jit
    def _qgemm_kernel(X, W, S, Y, M, N, K, G: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        pm, pn = tl.program_id(0), tl.program_id(1)
        rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < M, rn < N
        num_groups = K // G
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            x = tl.load(X + rm[:, None] * K + rk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            q = tl.load(W + rn[:, None] * K + rk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0)
            # one scale per (row, group), broadcast over the group's G codes
            gidx = k0 // G + tl.arange(0, BLOCK_K // G)
            scale = tl.load(S + rn[:, None] * num_groups + gidx[None, :],
                            mask=n_ok[:, None] & (gidx < num_groups)[None, :], other=0.0)
            w = tl.reshape(q.to(tl.float32), (BLOCK_N, BLOCK_K // G, G)) * scale[:, :, None]
            w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(X.dtype.element_ty)  # [BN, BK]
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        tl.store(Y + rm[:, None] * N + rn[None, :], acc.to(Y.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def qgemm_cuda(x: torch.Tensor, p: dict, scheme) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32) times packed int8 weights -> [M, N] in x.dtype."""
    rows, k = x.shape
    w = p["weight"]
    n = w.shape[0]
    block_m = min(128, max(16, triton.next_power_of_2(rows)))
    block_n = 32 if block_m <= 64 else 64
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
    fp32 = x.dtype == torch.float32  # 4-byte tiles: fewer stages fit in shared memory
    _qgemm_kernel[grid](x.contiguous(), w, p["scales"], y, rows, n, k, G=scheme.group_size,
                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64 if fp32 else 128, IEEE=fp32,
                        num_warps=4, num_stages=2 if fp32 else 3)
    return y
