"""The MLP's gate: silu(gate) * up over the two halves of the packed gate|up projection."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from deltaserve.ops.dispatch import REFERENCE, Case, Op
from deltaserve.ops.native import native_lib
from deltaserve.ops.norm import ROWS, native_why_not, row_case, triton_rows_why_not


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] -> silu(gate) * up [..., I], in gate_up's dtype (torch's two ops)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def sigmoid_gate_ref(o: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """Attention's output gate as the torch layer composes it: o [HQ,T,D] * sigmoid(gate) with
    head h's gate in proj [T,P] columns [h 2D + D, h 2D + 2D); returns [T, HQ*D]."""
    num_heads, _, dim = o.shape
    gate = proj[:, : 2 * num_heads * dim].reshape(-1, num_heads, 2 * dim)[..., dim:]
    return (o.transpose(0, 1) * torch.sigmoid(gate)).flatten(1)


SILU_MUL = Op("silu_mul", "the MLP gate: silu(gate) * up over the halves of gate|up", ROWS)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Same contract as silu_mul_ref (the Triton kernel computes in fp32 and rounds once)."""
    return SILU_MUL(row_case(gate_up), gate_up)


@SILU_MUL.register("triton", 30, triton_rows_why_not)
def _silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    from deltaserve.ops import triton_act

    return triton_act.silu_mul_cuda(gate_up)


def _native_why_not(c: Case) -> str | None:
    """Steps without prefill chunks (decodes, draft verification) on CPU fp32: the C loop the
    one-call decode step (ops/decode_step.py) runs, so both give the same bits. Prefill chunks of
    any size keep torch's vector op (a prefix-cache hit's short tail then computes as the miss's
    long chunk does)."""
    if not c.native_rows:
        return "a step with prefill chunks keeps torch's op"
    return native_why_not(c)


@SILU_MUL.register("native", 20, _native_why_not)
def _silu_mul_native(gate_up: torch.Tensor) -> torch.Tensor:
    lib = native_lib()
    rows = gate_up.numel() // gate_up.shape[-1]
    fn = lib.ds_silu_mul
    if fn.argtypes is None:  # registered beside its one Python caller
        fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2
        fn.restype = None
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    fn(gate_up.data_ptr(), out.data_ptr(), rows, inter)
    return out


SILU_MUL.register(REFERENCE, 0)(silu_mul_ref)
