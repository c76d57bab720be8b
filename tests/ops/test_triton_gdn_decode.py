"""The Triton GDN decode step on pool slots against the torch reference (run on the H200)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import triton_gdn_decode
from deltaserve.ops.gdn_decode import gdn_decode_slots_ref
from tests.ops.triton_device import KDEV, needs_kernels, rel

pytestmark = pytest.mark.gpu


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads_k", "heads_v", "dim"), [(16, 16, 128), (2, 4, 128), (2, 2, 32)])
def test_triton_slots_step_matches_reference(dtype, heads_k, heads_v, dim) -> None:
    """heads_k == heads_v takes the fused conv; grouped value heads the separate conv kernel."""
    torch.manual_seed(heads_v + dim)
    dev, num_slots, bsz = KDEV, 9, 5
    channels = 2 * heads_k * dim + heads_v * dim
    conv_w = torch.randn(channels, 4, device=dev) * 0.5
    a_log, dt_bias = torch.randn(heads_v, device=dev) * 0.3, torch.randn(heads_v, device=dev)
    norm_w = torch.rand(dim, device=dev) + 0.5
    conv_pool = (torch.randn(num_slots, channels, 3, device=dev)).to(dtype)
    state_pool = torch.randn(num_slots, heads_v, dim, dim, device=dev) * 0.1
    pools = {"ref": (conv_pool.clone(), state_pool.clone()),
             "triton": (conv_pool.clone(), state_pool.clone())}
    slots = torch.tensor([7, 2, 0, 5, 3], device=dev)
    for step in range(3):
        # views of one projection output, as the layer passes them (row stride > width)
        widths = [channels, heads_v * dim, heads_v, heads_v, 5]
        proj = torch.randn(bsz, sum(widths), device=dev).to(dtype)
        qkv, z, b, a, _ = torch.split(proj, widths, dim=-1)
        cr, sr = pools["ref"]
        ref = gdn_decode_slots_ref(qkv, z, b, a, cr, conv_w, a_log, dt_bias, sr, slots, norm_w,
                                   1e-6, heads_k)
        ct, st = pools["triton"]
        out = torch.full((bsz, heads_v * dim), float("nan"), dtype=dtype, device=dev)
        got = triton_gdn_decode.gdn_decode_slots_cuda(qkv, z, b, a, ct, conv_w, a_log, dt_bias,
                                                      st, slots, norm_w, 1e-6, heads_k, out)
        assert got is out  # written in place, in the caller's dtype
        assert rel(out, ref) <= (1e-5 if dtype == torch.float32 else 8e-3), step
    (cr, sr), (ct, st) = pools["ref"], pools["triton"]
    assert rel(st, sr) <= 1e-5
    assert torch.equal(ct.float(), cr.float())  # the window shift moves values, no arithmetic
    untouched = [1, 4, 6, 8]
    assert torch.equal(st[untouched], state_pool[untouched])
    assert torch.equal(ct[untouched], conv_pool[untouched])
