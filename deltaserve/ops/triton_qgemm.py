"""Decode-batch GEMM on packed int8 weights for CUDA GPUs (Triton): y = x W^T with W read as int8
codes. Each K step is one quantization group: the codes convert exactly to the activation dtype
(|q| <= 127 fits a bf16 mantissa), one tensor-core dot of x and the codes gives the group's partial
sums in fp32, and the group scale multiplies those [BLOCK_M, BLOCK_N] sums, not every weight. Each
weight byte is read once per step for all rows, where dequantize-then-GEMM would write and re-read
a 16-bit copy of every weight.

Outputs narrower than the GPU (N = 1024 of the 0.8B out_proj / down_proj) split K over SPLIT
programs per tile; each writes fp32 partial sums and a second launch adds them up in order
(deterministic, no atomics).

Contract: F.linear(x, dequantize(p, scheme, fp32)) within fp32 rounding (the scale is applied to a
group's sum instead of being rounded into each weight first), tests/ops/test_triton_qgemm.py.
Shapes: x [M, K] (M <= MAX_ROWS: a decode batch or a short prefill chunk), codes [N, K] int8,
scales [N, K/G]. The launch shape comes from launch_config (scripts/gpu/qgemm_tune.py times
alternatives against cuBLAS on the dequantized weights).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from deltaserve.ops.backend import tl, triton
from deltaserve.ops.backend import triton_enabled as available  # noqa: F401 (callers ask here)

MAX_ROWS = 256
MIN_GROUP, MAX_GROUP = 16, 128  # one group per dot: tl.dot needs K >= 16; wider groups spill


class Config(NamedTuple):
    block_m: int
    block_n: int
    split: int  # programs per output tile along K (1: no reduction launch)
    num_warps: int
    num_stages: int


if triton is not None:

    @triton.jit
    def _qgemm_kernel(X, W, S, Y, P, M, N, K, groups_per_split, G: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                      SPLIT: tl.constexpr):
        pm, pn, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < M, rn < N
        num_groups = K // G
        rk = tl.arange(0, G)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for i in range(0, groups_per_split):
            # the last split may run past the groups: masked loads add zeros there
            g = ps * groups_per_split + i
            g_ok = g < num_groups
            x = tl.load(X + rm[:, None] * K + (g * G + rk)[None, :], mask=m_ok[:, None] & g_ok,
                        other=0.0)
            q = tl.load(W + rn[:, None] * K + (g * G + rk)[None, :], mask=n_ok[:, None] & g_ok,
                        other=0)
            scale = tl.load(S + rn * num_groups + g, mask=n_ok & g_ok, other=0.0).to(tl.float32)
            if IEEE:
                part = tl.dot(x, tl.trans(q.to(tl.float32)), input_precision="ieee")
            else:  # codes are exact in bf16 / fp16; products are exact in the fp32 accumulator
                part = tl.dot(x, tl.trans(q.to(X.dtype.element_ty)))
            acc += part * scale[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        if SPLIT == 1:
            tl.store(Y + rm[:, None] * N + rn[None, :], acc.to(Y.dtype.element_ty), mask=mask)
        else:
            tl.store(P + ps * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)

    @triton.jit
    def _split_sum_kernel(P, Y, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < MN
        total = tl.zeros([BLOCK], tl.float32)
        for s in range(SPLIT):  # in order: the same sum on every run
            total += tl.load(P + s * MN + offs, mask=ok, other=0.0)
        tl.store(Y + offs, total.to(Y.dtype.element_ty), mask=ok)


def supports(scheme) -> bool:
    """Group sizes this kernel takes (one group per tensor-core step)."""
    g = scheme.group_size
    return MIN_GROUP <= g <= MAX_GROUP and g & (g - 1) == 0


def launch_config(rows: int, n: int, k: int, group: int, num_sms: int = 132) -> Config:
    """The launch shape by batch size and output width, from scripts/gpu/qgemm_tune.py's H200 sweep
    (docs/benchmarks/2026-11-30-h200-qgemm-tune.json; on the 0.8B layer shapes its totals are within
    2% of the sweep's best at 8, 32 and 128 rows, 5120x1024 at 32 rows 10% off the best there):
    - up to 16 rows: 32-wide tiles (more programs for a thin GEMM), 4 stages;
    - 17-64 rows: 64-wide tiles, 4 stages; more rows: 32-wide tiles, 3 stages;
    - the vocabulary head (N >= 100k, many tiles anyway): 64-wide tiles up to 16 rows, 128-wide
      beyond, at most 64 rows per tile;
    - outputs whose tiles fill under half the GPU (N = 1024): K split in powers of two up to
      two waves, keeping >= 4 groups per program."""
    block_m = min(128, max(16, triton.next_power_of_2(rows)))
    if n >= 100_000:
        block_m, block_n, stages = min(block_m, 64), (64 if rows <= 16 else 128), 4
    elif rows <= 16:
        block_n, stages = 32, 4
    elif rows <= 64:
        block_n, stages = 64, 4
    else:
        block_n, stages = 32, 3
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(n, block_n)
    num_groups = k // group
    split = 1
    while tiles * 2 <= num_sms and tiles * split * 2 <= 2 * num_sms \
            and num_groups // (split * 2) >= 4:
        split *= 2
    return Config(block_m, block_n, split, num_warps=4, num_stages=stages)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Multiprocessors of the device (asked once per device: qgemm_cuda runs per projection)."""
    return torch.cuda.get_device_properties(device).multi_processor_count \
        if device.type == "cuda" else 132


def qgemm_cuda(x: torch.Tensor, p: dict, scheme, config: Config | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32) times packed int8 weights -> [M, N] in x.dtype."""
    rows, k = x.shape
    w = p["weight"]
    n, g = w.shape[0], scheme.group_size
    fp32 = x.dtype == torch.float32
    if config is None:
        config = launch_config(rows, n, k, g, _num_sms(x.device))
        if fp32:  # 4-byte tiles: fewer stages fit in shared memory
            config = config._replace(num_stages=2)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    split = config.split
    part = torch.empty(split, rows, n, dtype=torch.float32, device=x.device) if split > 1 else y
    groups_per_split = triton.cdiv(k // g, split)
    grid = (triton.cdiv(rows, config.block_m), triton.cdiv(n, config.block_n), split)
    _qgemm_kernel[grid](x.contiguous(), w, p["scales"], y, part, rows, n, k, groups_per_split,
                        G=g, BLOCK_M=config.block_m, BLOCK_N=config.block_n, IEEE=fp32,
                        SPLIT=split, num_warps=config.num_warps, num_stages=config.num_stages)
    if split > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(rows * n, block),)](part, y, rows * n, SPLIT=split,
                                                           BLOCK=block, num_warps=4)
    return y
