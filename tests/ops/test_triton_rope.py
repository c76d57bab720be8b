"""Triton partial rotary embedding against layers/rotary.apply_rotary (run on the H200)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.layers.rotary import Rotary, apply_rotary
from deltaserve.ops import triton_rope

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not triton_rope.available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("seq_len", [1, 7, 40])
def test_triton_rotary_matches_reference(seq_len) -> None:
    torch.manual_seed(seq_len)
    rot = Rotary(64, 1e7, torch.device("cuda"))
    cos, sin = rot.cos_sin(torch.arange(100, 100 + seq_len, device="cuda"), torch.float32)
    base = torch.randn(1, seq_len, 8, 256, device="cuda")
    x = base.transpose(1, 2)  # [1,H,T,D] strided, as the layer passes it
    out, ref = triton_rope.apply_rotary_cuda(x, cos, sin), apply_rotary(x, cos, sin)
    assert out.shape == ref.shape
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-6
    assert torch.equal(out[..., 64:], ref[..., 64:])  # the unrotated dims pass through untouched
