"""Decode GEMV on dense 16-bit weights for CUDA GPUs (Triton), fp32 accumulation.

Batch-1 decode runs ~97 dense GEMVs per token (x [1, K] times W [N, K]); there cuBLAS is bound by
launch latency and small grids, not by bandwidth. One program computes BLOCK_N output rows and walks
K in steps of BLOCK_K columns: a [BLOCK_N, BLOCK_K] tile of W (contiguous along K, so coalesced),
times x, accumulated elementwise in fp32 and reduced once after the loop (as the int8 path of
ops/triton_qgemv; no tl.dot, which buys nothing for one row). SPLIT_K > 1 adds a second grid axis
over K for shapes with few rows and long K (too few programs to fill the GPU): each split writes
fp32 partials [SPLIT_K, N] that torch sums, deterministic where atomics would not be.

The reference is F.linear on fp32 copies. layers/linear.linear dispatches here only for shapes in
TUNED, i.e. only where scripts/gpu/gemv_tune.py's H200 run showed this kernel beating cuBLAS.
"""

from __future__ import annotations

import torch

from deltaserve.ops import gemv_prologue, tuning
from deltaserve.ops.backend import pdl_args, tl, triton
from deltaserve.ops.backend import triton_enabled as available  # noqa: F401 (callers ask here)

if triton is not None:
    from deltaserve.ops.backend import gdc_launch_dependents, gdc_wait
    from deltaserve.ops.gemv_prologue import rstd_of, x_at

    @triton.jit
    def _gemv16_kernel(W, X, Y, N, K, K_PER_SPLIT, R, NW, TOTAL, eps, offset,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                       XMODE: tl.constexpr, NORM_BLOCK: tl.constexpr, PDL: tl.constexpr):
        """XMODE: x through a prologue (ops/gemv_prologue; program (0, 0) stores AddNorm's sum).
        PDL: launched with programmatic dependent launch; the first K-step's weights (static) are
        loaded before gdc_wait, x and everything after it."""
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        k_lo = pid_k * K_PER_SPLIT  # K_PER_SPLIT is a multiple of BLOCK_K: splits never overlap
        cols = k_lo + tl.arange(0, BLOCK_K)
        w = tl.load(W + rows[:, None] * K + cols[None, :],
                    mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)
        if PDL:
            gdc_wait()  # the predecessor is complete and its writes (our x) are visible
            gdc_launch_dependents()
        rstd = rstd_of(X, R, K, eps, TOTAL, pid_n + pid_k, XMODE, NORM_BLOCK)
        acc += w.to(tl.float32) * x_at(X, R, NW, cols, cols < K, K, rstd, offset, XMODE)[None, :]
        for k0 in range(k_lo + BLOCK_K, k_lo + K_PER_SPLIT, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            w = tl.load(W + rows[:, None] * K + cols[None, :],
                        mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            x = x_at(X, R, NW, cols, col_ok, K, rstd, offset, XMODE)
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if SPLIT_K == 1:
            tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)
        else:  # fp32 partials: row pid_k of [SPLIT_K, N]
            tl.store(Y + pid_k * N + rows, y, mask=row_ok)


# (K, N window [lo, hi)) -> (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K): the best L2-cold
# config per Qwen3.5 0.8B / 2B decode shape on one H200, every entry faster than cuBLAS there; a
# shape without an entry keeps F.linear. 0.8B GEMVs per token: 913 us cuBLAS -> 589 us with these.
# Data with provenance: ops/tuning/h200-triton-gemv.json (`python scripts/gpu/gemv_tune.py`).
Config = tuple[int, int, int, int, int]
TUNED: dict[tuple[int, int, int], Config] = tuning.table("h200-triton-gemv")
# Explicit calls without a config and outside TUNED (tests, the tune script's baseline).
DEFAULT: Config = (8, 512, 4, 1, 1)


def config_for(n: int, k: int) -> Config | None:
    """The tuned config for an [n, k] weight, or None: cuBLAS is (or may be) faster there."""
    for (kk, lo, hi), cfg in TUNED.items():
        if kk == k and lo <= n < hi:
            return cfg
    return None


def gemv16_cuda(x: torch.Tensor, weight: torch.Tensor, config: Config | None = None,
                prologue: gemv_prologue.Prologue | None = None) -> torch.Tensor:
    """x [1, K] (bf16 / fp16 / fp32) times weight [N, K] (contiguous, 16-bit; fp32 also works)
    -> [1, N] in x's dtype, fp32 math inside the kernel (no cast kernels around it). prologue
    (ops/gemv_prologue): the GEMV reads rms_norm(residual + x) or silu(gate) * up of x instead."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[0] != 1 or gemv_prologue.gemv_cols(x, prologue) != k:
        raise ValueError(f"gemv16_cuda: x must be [1, {k}] (or [1, {2 * k}] with SiluMul), got "
                         f"{list(x.shape)}")
    gemv_prologue.check(x, prologue, k)
    if not weight.is_contiguous():
        raise ValueError("gemv16_cuda: weight must be contiguous")
    config = config or config_for(n, k) or DEFAULT
    return _launch(x.contiguous(), weight, config, prologue)


def _launch(x: torch.Tensor, weight: torch.Tensor, config: Config,
            prologue: gemv_prologue.Prologue | None = None) -> torch.Tensor:
    block_n, block_k, warps, stages, split_k = config
    n, k = weight.shape
    if split_k == 1:
        y = torch.empty(1, n, dtype=x.dtype, device=x.device)
        k_per_split = k
    else:
        y = torch.empty(split_k, n, dtype=torch.float32, device=x.device)
        k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    _gemv16_kernel[(triton.cdiv(n, block_n), split_k)](
        weight, x, y, n, k, k_per_split, **gemv_prologue.kernel_args(x, prologue),
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=warps, num_stages=stages,
        **pdl_args())
    if split_k == 1:
        return y
    return y.sum(dim=0, keepdim=True).to(x.dtype)
