"""silu(gate) * up for CUDA GPUs (Triton): one kernel instead of torch's two (and their
intermediate), fp32 math rounded once. Contract: ops/activation.silu_mul_ref
(tests/ops/test_triton_act.py). Also attention's output gate over a prefill chunk,
o * sigmoid(gate) written into the o_proj input rows: torch's strided sigmoid, multiply and copy
took ~80 us per layer at 8k tokens (contract: ops/activation.sigmoid_gate_ref)."""

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


    @triton.jit
    def _sigmoid_gate_kernel(O, G, Y, T, O_HEAD, O_ROW, G_ROW, Y_ROW, D: tl.constexpr,
                             BLOCK_T: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        head = tl.program_id(1)
        dims = tl.arange(0, D)
        ok = (rows < T)[:, None]
        o = tl.load(O + head * O_HEAD + rows[:, None] * O_ROW + dims[None, :], mask=ok, other=0.0)
        g = tl.load(G + rows[:, None] * G_ROW + head * 2 * D + D + dims[None, :], mask=ok,
                    other=0.0).to(tl.float32)
        y = o.to(tl.float32) / (1.0 + tl.exp(-g))
        tl.store(Y + rows[:, None] * Y_ROW + head * D + dims[None, :], y.to(Y.dtype.element_ty),
                 mask=ok)


def sigmoid_gate_cuda(o: torch.Tensor, proj: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, HQ*D] (rows of any stride) = o [HQ,T,D] * sigmoid(gate), the gate of head h in
    proj [T, P] columns [h 2D + D, h 2D + 2D) (the per-head [query | gate] layout); D a power
    of two; unit inner strides."""
    num_heads, num_tokens, dim = o.shape
    if o.stride(-1) != 1 or proj.stride(-1) != 1 or out.stride(-1) != 1 or dim & (dim - 1):
        raise ValueError("sigmoid_gate_cuda needs unit inner strides and a power-of-two head dim")
    block_t = 16
    grid = (triton.cdiv(num_tokens, block_t), num_heads)
    _sigmoid_gate_kernel[grid](o, proj, out, num_tokens, o.stride(0), o.stride(1), proj.stride(0),
                               out.stride(0), D=dim, BLOCK_T=block_t)


def silu_mul_cuda(gate_up: torch.Tensor) -> torch.Tensor:
    half = gate_up.shape[-1] // 2
    flat = gate_up.reshape(-1, 2 * half).contiguous()
    out = torch.empty(flat.shape[0], half, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(flat.shape[0], triton.cdiv(half, BLOCK))](flat, out, half, BLOCK=BLOCK,
                                                                **pdl_args())
    return out.reshape(*gate_up.shape[:-1], half)
