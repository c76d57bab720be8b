"""The Triton GDN decode step on pool slots against the torch reference (run on the H200)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import triton_gdn_decode
from deltaserve.ops.gdn_decode import gdn_decode_slots_ref

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not triton_gdn_decode.available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("conv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads_k", "heads_v"), [(16, 16), (2, 4)])
def test_triton_slots_step_matches_reference(conv_dtype, heads_k, heads_v) -> None:
    torch.manual_seed(heads_v)
    dev, k_dim, v_dim, num_slots, bsz = "cuda", 128, 128, 9, 5
    channels = 2 * heads_k * k_dim + heads_v * v_dim
    conv_w = torch.randn(channels, 4, device=dev) * 0.5
    a_log, dt_bias = torch.randn(heads_v, device=dev) * 0.3, torch.randn(heads_v, device=dev)
    norm_w = torch.rand(v_dim, device=dev) + 0.5
    conv_pool = (torch.randn(num_slots, channels, 3, device=dev)).to(conv_dtype)
    state_pool = torch.randn(num_slots, heads_v, k_dim, v_dim, device=dev) * 0.1
    pools = {"ref": (conv_pool.clone(), state_pool.clone()),
             "triton": (conv_pool.clone(), state_pool.clone())}
    slots = torch.tensor([7, 2, 0, 5, 3], device=dev)
    for step in range(3):
        # views of one projection output, as the layer passes them (row stride > width)
        widths = [channels, heads_v * v_dim, heads_v, heads_v, 5]
        proj = torch.randn(bsz, sum(widths), device=dev).to(conv_dtype)
        qkv, z, b, a, _ = torch.split(proj, widths, dim=-1)
        outs = {}
        for name, fn in (("ref", gdn_decode_slots_ref),
                         ("triton", triton_gdn_decode.gdn_decode_slots_cuda)):
            cp, sp = pools[name]
            outs[name] = fn(qkv, z, b, a, cp, conv_w, a_log, dt_bias, sp, slots, norm_w, 1e-6,
                            heads_k)
        rel = ((outs["triton"] - outs["ref"]).norm() / outs["ref"].norm()).item()
        assert rel <= 1e-5, (step, rel)
    (cr, sr), (ct, st) = pools["ref"], pools["triton"]
    assert ((st - sr).norm() / sr.norm()).item() <= 1e-5
    assert torch.equal(ct.float(), cr.float())  # the window shift moves values, no arithmetic
    untouched = [1, 4, 6, 8]
    assert torch.equal(st[untouched], state_pool[untouched])
