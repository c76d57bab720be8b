"""Triton silu(gate) * up against ops/activation.silu_mul_ref (run on the H200)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import triton_act
from deltaserve.ops.activation import sigmoid_gate_ref, silu_mul_ref
from tests.ops.triton_device import KDEV, needs_kernels, rel

pytestmark = pytest.mark.gpu


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "half"), [(1, 3584), (5, 100)])
def test_triton_silu_mul_matches_reference(dtype, rows, half) -> None:
    torch.manual_seed(rows)
    x = (torch.randn(1, rows, 2 * half, device=KDEV) * 3).to(dtype)
    out, ref = triton_act.silu_mul_cuda(x), silu_mul_ref(x)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert rel(out, ref) <= (1e-6 if dtype == torch.float32 else 8e-3)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_sigmoid_gate_matches_reference(dtype) -> None:
    """o [HQ,T,D] from attention times sigmoid of the gate half of each head's projection, into
    rows of a wider buffer (the o_proj input of a step whose chunk starts at row 3)."""
    torch.manual_seed(4)
    heads, tokens, dim = 3, 37, 64
    # token-major, as SDPA leaves it: [T,HQ,D] memory seen as [HQ,T,D]
    o = torch.randn(tokens, heads, dim, device=KDEV).to(dtype).transpose(0, 1)
    proj = (torch.randn(tokens, 2 * heads * dim + 96, device=KDEV) * 3).to(dtype)
    buf = torch.full((tokens + 5, heads * dim), 7.0, device=KDEV).to(dtype)
    triton_act.sigmoid_gate_cuda(o, proj, buf[3 : 3 + tokens])
    ref = sigmoid_gate_ref(o.float(), proj.float())
    assert rel(buf[3 : 3 + tokens], ref) <= (1e-6 if dtype == torch.float32 else 8e-3)
    assert (buf[:3] == 7).all() and (buf[3 + tokens :] == 7).all()  # no row outside the span
