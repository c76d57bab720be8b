"""silu(gate) * up for CUDA GPUs (Triton): one kernel instead of torch's two (and their
intermediate), fp32 math rounded once. Contract: ops/activation.silu_mul_ref
(tests/ops/test_triton_act.py)."""

from __future__ import annotations

import torch

from deltaserve.ops.backend import pdl_args, tl, triton
from deltaserve.ops.backend import triton_enabled as available  # noqa: F401 (callers ask here)

BLOCK = 1024

if triton is not None:
    from deltaserve.ops.backend import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _silu_mul_kernel(X, Y, HALF, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # programmatic dependent launch: wait for the predecessor's writes, let the
            gdc_wait()  # next kernel launch (and prefetch its static operands) meanwhile
            gdc_launch_dependents()
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < HALF
        g = tl.load(X + row * 2 * HALF + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(X + row * 2 * HALF + HALF + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + row * HALF + cols, (g / (1.0 + tl.exp(-g)) * u).to(Y.dtype.element_ty),
                 mask=ok)


def silu_mul_cuda(gate_up: torch.Tensor) -> torch.Tensor:
    half = gate_up.shape[-1] // 2
    flat = gate_up.reshape(-1, 2 * half).contiguous()
    out = torch.empty(flat.shape[0], half, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(flat.shape[0], triton.cdiv(half, BLOCK))](flat, out, half, BLOCK=BLOCK,
                                                                **pdl_args())
    return out.reshape(*gate_up.shape[:-1], half)
