"""The one-pass Triton prefill conv against ops/conv1d.causal_conv1d_ref (run on the H200; fp32
also under TRITON_INTERPRET)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import triton_conv1d
from deltaserve.ops.conv1d import causal_conv1d_ref
from tests.ops.triton_device import KDEV, needs_kernels, rel

pytestmark = pytest.mark.gpu


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("seq_len", "channels"), [(2, 96), (70, 300)])
def test_prefill_conv_matches_reference(dtype, seq_len, channels) -> None:
    torch.manual_seed(seq_len)
    proj = torch.randn(1, seq_len, channels + 17, device=KDEV).to(dtype)
    x = proj[..., 5 : 5 + channels]  # a view of a projection, as the layer passes it
    weight = torch.randn(channels, 4, device=KDEV) * 0.5
    window = torch.randn(1, channels, 3, device=KDEV).to(dtype)
    out = triton_conv1d.causal_conv1d_cuda(x, weight, window)
    ref = causal_conv1d_ref(x, weight, window)
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel(out, ref) <= (1e-6 if dtype == torch.float32 else 8e-3)
