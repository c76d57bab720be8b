"""RMSNorms for CUDA GPUs (Triton): one kernel per norm instead of torch's ~9 (cast, square, mean,
add, rsqrt, two multiplies, weight offset, cast back), the bulk of a decode step's launches; the
residual add before a norm rides in the same kernel. Contracts: ops/norm.rms_norm_ref,
gated_rms_norm_ref and add_rms_norm_ref (tests/ops/test_triton_norm.py).
"""

from __future__ import annotations

import torch

from deltaserve.ops.backend import pdl_args, tl, triton
from deltaserve.ops.backend import triton_enabled as available  # noqa: F401 (callers ask here)

if triton is not None:
    from deltaserve.ops.backend import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _rms_kernel(X, W, Z, Y, N, Z_STRIDE, GROUPS, eps, offset, HAS_GATE: tl.constexpr,
                    BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # programmatic dependent launch: wait for the predecessor's writes, let the
            gdc_wait()  # next kernel launch (and prefetch its static operands) meanwhile
            gdc_launch_dependents()
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(X + row * N + cols, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32) + offset
        y = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps) * w
        if HAS_GATE:
            # z row r of a [rows/GROUPS, GROUPS*N] view with row stride Z_STRIDE
            z_ptr = Z + (row // GROUPS) * Z_STRIDE + (row % GROUPS) * N + cols
            z = tl.load(z_ptr, mask=ok, other=0.0).to(tl.float32)
            y = y * (z / (1.0 + tl.exp(-z)))
        tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _rms_rows_kernel(X, W, Z, Y, M, N, Z_STRIDE, GROUPS, eps, offset, HAS_GATE: tl.constexpr,
                         BLOCK: tl.constexpr, ROWS: tl.constexpr):
        """_rms_kernel over ROWS rows per program: a prefill's gated norm has T*HV rows of 128
        (131k programs of one row each at 8k tokens ran at ~1/6 of the bandwidth)."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        ok = (rows < M)[:, None] & (cols < N)[None, :]
        x = tl.load(X + rows[:, None] * N + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32) + offset
        y = x * tl.rsqrt(tl.sum(x * x, 1) / N + eps)[:, None] * w[None, :]
        if HAS_GATE:
            z_ptr = Z + ((rows // GROUPS) * Z_STRIDE + (rows % GROUPS) * N)[:, None] + cols[None, :]
            z = tl.load(z_ptr, mask=ok, other=0.0).to(tl.float32)
            y = y * (z / (1.0 + tl.exp(-z)))
        tl.store(Y + rows[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _add_rms_kernel(X, R, W, S, Y, N, eps, offset, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # programmatic dependent launch: wait for the predecessor's writes, let the
            gdc_wait()  # next kernel launch (and prefetch its static operands) meanwhile
            gdc_launch_dependents()
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(X + row * N + cols, mask=ok, other=0.0).to(tl.float32)
        r = tl.load(R + row * N + cols, mask=ok, other=0.0).to(tl.float32)
        # the residual stream is rounded to its dtype first, as `residual + x` in torch would be
        s = (x + r).to(S.dtype.element_ty)
        tl.store(S + row * N + cols, s, mask=ok)
        sf = s.to(tl.float32)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32) + offset
        y = sf * tl.rsqrt(tl.sum(sf * sf, 0) / N + eps) * w
        tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=ok)


def add_rms_norm_cuda(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ops/norm.add_rms_norm_ref's contract: (rms_norm(residual + x), residual + x), one kernel."""
    dim = x.shape[-1]
    flat_x, flat_r = x.reshape(-1, dim).contiguous(), residual.reshape(-1, dim).contiguous()
    total, normed = torch.empty_like(flat_r), torch.empty_like(flat_r)
    _add_rms_kernel[(flat_x.shape[0],)](flat_x, flat_r, weight.contiguous(), total, normed, dim,
                                        eps, offset, BLOCK=triton.next_power_of_2(dim),
                                        **pdl_args())
    return normed.reshape(residual.shape), total.reshape(residual.shape)


MANY_ROWS, ROWS_PER_PROGRAM = 4096, 16  # from this many rows on: _rms_rows_kernel
ROW_ELEMENTS = 2048  # at most this many elements per program (16 heads of 128; 2 rows of 1,024)


def _rms(flat: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, out: torch.Tensor,
         z_stride: int, groups: int, eps: float, offset: float, has_gate: bool) -> None:
    """One launch of the row kernel that suits flat [M,N]'s row count (decode steps keep one row
    per program: their bits do not depend on how many rows share the step)."""
    num_rows, dim = flat.shape
    block = triton.next_power_of_2(dim)
    rows = min(ROWS_PER_PROGRAM, ROW_ELEMENTS // block)  # wide rows: fewer per program
    if num_rows >= MANY_ROWS and rows > 1:
        grid = (triton.cdiv(num_rows, rows),)
        _rms_rows_kernel[grid](flat, weight.contiguous(), gate, out, num_rows, dim, z_stride,
                               groups, eps, offset, HAS_GATE=has_gate, BLOCK=block, ROWS=rows)
        return
    _rms_kernel[(num_rows,)](flat, weight.contiguous(), gate, out, dim, z_stride, groups, eps,
                             offset, HAS_GATE=has_gate, BLOCK=block, **pdl_args())


def rms_norm_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """rms_norm_ref's contract: fp32 math, output in x.dtype."""
    dim = x.shape[-1]
    flat = x.reshape(-1, dim).contiguous()
    out = torch.empty_like(flat)
    _rms(flat, weight, flat, out, 0, 1, eps, offset, has_gate=False)
    return out.reshape(x.shape)


def gated_rms_norm_cuda(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                        out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """gated_rms_norm_ref's contract: rms_norm(x) * w * silu(z) in fp32, rounded once to out_dtype
    (as .to(out_dtype) of the fp32 result would). x [..., N];
    z either x's shape or [R, G*N] (rows of G heads, e.g. a view of a projection's output with
    unit column stride: read in place)."""
    dim = x.shape[-1]
    flat = x.reshape(-1, dim).contiguous()
    if z.dim() == 2 and z.stride(-1) == 1 and z.shape[-1] % dim == 0 and \
            z.shape[0] * (z.shape[-1] // dim) == flat.shape[0]:
        gate, groups, z_stride = z, z.shape[-1] // dim, z.stride(0)
    else:
        gate = z.reshape(-1, dim).contiguous()
        groups, z_stride = 1, dim
    out = torch.empty(flat.shape, dtype=out_dtype, device=x.device)
    _rms(flat, weight, gate, out, z_stride, groups, eps, 0.0, has_gate=True)
    return out.reshape(x.shape)
