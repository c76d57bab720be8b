"""The greedy head for CUDA GPUs (Triton): logits of up to 16 rows over a tile of vocabulary rows,
reduced in the same kernel to the tile's maximum and its index; a torch argmax over the tiles
picks the token. The [rows, vocab] logits never reach memory (1 MB per row for 248,320 tokens).

Dense heads (bf16 / fp16 / fp32) use one tl.dot per K step over the rows padded to 16; packed
int8 / 4-bit heads reuse the decode GEMV (ops/triton_qgemv) with its argmax epilogue, one launch
per row. Contract: argmax over fp32 logits of the head (ties: the first index), as
ops/greedy_head.greedy_tokens_ref (tests/ops/test_triton_head.py).
"""

from __future__ import annotations

import torch

from deltaserve.ops.backend import pdl_args, tl, triton
from deltaserve.ops.backend import triton_enabled as available  # noqa: F401 (callers ask here)

MAX_ROWS = 16
BLOCK_N, BLOCK_K, NUM_WARPS = 64, 128, 4

if triton is not None:
    from deltaserve.ops.backend import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _dense_argmax_kernel(W, X, VALS, IDX, R, N, K, NUM_TILES, BLOCK_R: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                             PDL: tl.constexpr):
        if PDL:  # programmatic dependent launch: wait for the predecessor's writes, let the
            gdc_wait()  # next kernel launch (and prefetch its static operands) meanwhile
            gdc_launch_dependents()
        tile = tl.program_id(0)
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        rs = tl.arange(0, BLOCK_R)
        ok, r_ok = rows < N, rs < R
        acc = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            c_ok = cols < K
            w = tl.load(W + rows[:, None] * K + cols[None, :], mask=ok[:, None] & c_ok[None, :],
                        other=0.0)
            x = tl.load(X + rs[:, None] * K + cols[None, :], mask=r_ok[:, None] & c_ok[None, :],
                        other=0.0).to(w.dtype)
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        logits = tl.where(ok[None, :], acc, float("-inf"))
        best = tl.max(logits, 1)
        idx = tl.argmax(logits, 1, tie_break_left=True)
        tl.store(VALS + rs * NUM_TILES + tile, best, mask=r_ok)
        tl.store(IDX + rs * NUM_TILES + tile, tile * BLOCK_N + idx, mask=r_ok)


def _pick(vals: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Per row the tile with the largest maximum (the first on ties) and its index."""
    return idx.gather(1, vals.argmax(dim=1, keepdim=True))[:, 0].long()


def greedy_dense_cuda(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h [R, K] (R <= MAX_ROWS), weight [N, K] dense -> argmax tokens [R] int64."""
    rows, k = h.shape
    n = weight.shape[0]
    tiles = triton.cdiv(n, BLOCK_N)
    vals = torch.empty(rows, tiles, dtype=torch.float32, device=h.device)
    idx = torch.empty(rows, tiles, dtype=torch.int32, device=h.device)
    _dense_argmax_kernel[(tiles,)](weight, h.contiguous(), vals, idx, rows, n, k, tiles,
                                   BLOCK_R=16, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                   IEEE=weight.dtype == torch.float32, num_warps=NUM_WARPS,
                                   **pdl_args())
    return _pick(vals, idx)


def greedy_packed_cuda(h: torch.Tensor, module) -> torch.Tensor:
    """h [R, K]; `module` a packed int8 / 4-bit affine / q1 head -> argmax tokens [R] int64."""
    from deltaserve.ops.triton_qgemv import qgemv_argmax_cuda
    from deltaserve.quant.linear import packed

    p = packed(module)
    parts = [qgemv_argmax_cuda(h[r : r + 1], p, module.scheme) for r in range(h.shape[0])]
    vals = torch.cat([v for v, _ in parts])
    idx = torch.cat([i for _, i in parts])
    return _pick(vals, idx)
