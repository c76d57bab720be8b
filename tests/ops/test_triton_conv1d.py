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


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("seq_len", "key_dim", "value_dim", "head_dim"),
                         [(70, 256, 256, 128), (37, 128, 300, 64)])  # more v channels, a partial tile
def test_conv_qkv_split_matches_reference(dtype, seq_len, key_dim, value_dim, head_dim) -> None:
    """The conv written as contiguous q, k, v with q and k L2-normalised per head (what fla's
    stages read): against the conv reference, split and normalised in torch."""
    from deltaserve.ops.conv1d import causal_conv1d_qkv_ref

    torch.manual_seed(seq_len + value_dim)
    channels = 2 * key_dim + value_dim
    proj = torch.randn(1, seq_len, channels + 40, device=KDEV).to(dtype)
    x = proj[..., :channels]  # the in-projection's conv part: a view with a longer row
    weight = torch.randn(channels, 4, device=KDEV) * 0.5
    window = torch.randn(1, channels, 3, device=KDEV).to(dtype)
    got = triton_conv1d.causal_conv1d_qkv_cuda(x, weight, window, key_dim, head_dim, block_t=16)
    want = causal_conv1d_qkv_ref(x, weight, window, key_dim, head_dim)
    for out, ref in zip(got, want, strict=True):
        assert out.is_contiguous() and out.dtype == dtype and out.shape == ref.shape
        assert rel(out, ref) <= (1e-6 if dtype == torch.float32 else 8e-3)
    norms = got[1].float().unflatten(-1, (-1, head_dim)).norm(dim=-1)
    assert (norms - 1).abs().max().item() <= (1e-5 if dtype == torch.float32 else 1e-2)


@needs_kernels
@pytest.mark.parametrize(("channels", "key_dim", "head_dim"),
                         [(3 * 96, 96, 96), (3 * 192, 192, 128), (256, 128, 64)],
                         ids=["head-not-pow2", "heads-across-tiles", "no-v-channels"])
def test_conv_qkv_split_refuses_what_it_cannot_split(channels, key_dim, head_dim) -> None:
    x = torch.randn(1, 8, channels, device=KDEV)
    with pytest.raises(ValueError, match="whole heads"):
        triton_conv1d.causal_conv1d_qkv_cuda(x, torch.randn(channels, 4, device=KDEV),
                                             torch.zeros(1, channels, 3, device=KDEV), key_dim,
                                             head_dim)
