"""Triton silu(gate) * up against ops/activation.silu_mul_ref (run on the H200)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import triton_act
from deltaserve.ops.activation import silu_mul_ref
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
