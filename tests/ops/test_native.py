"""Native CPU kernels (decode GEMV, fused GDN decode step) against their torch references."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.gdn_decode import gdn_decode_slots, gdn_decode_slots_ref
from deltaserve.ops.gemv import gemm_small, gemv, gemv_ref
from deltaserve.ops.native import native_lib, simd_lanes

pytestmark = pytest.mark.skipif(native_lib() is None, reason="no C compiler: torch paths only")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# fp32 accumulation, only the summation order differs. The vector builds sum in 16 lanes (2.7e-7
# from the fp64 product at K = 3584); the scalar build (ARM, plain x86-64) in one running sum,
# 1.07e-6 there (and the reference itself is 2.6-5.6e-7 off): 1.1-1.2e-6 apart at that K
GEMV_BOUND = 1e-6 if simd_lanes() else 2e-6


@pytest.mark.parametrize("rows,cols", [(8224, 1024), (1024, 3584), (13, 64), (7, 100), (16, 1024)])
def test_gemv_matches_reference(rows: int, cols: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    x = torch.randn(1, cols, generator=gen)
    out = gemv(x, w)
    assert out.dtype == torch.float32 and out.shape == (1, rows)
    assert rel(out, gemv_ref(x, w)) <= GEMV_BOUND


def _gdn_inputs(bsz: int, heads_k: int, heads_v: int, k_dim: int, v_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    conv_dim = 2 * heads_k * k_dim + heads_v * v_dim
    r = lambda *shape, s=1.0: torch.randn(*shape, generator=gen) * s  # noqa: E731
    return dict(
        qkv=r(bsz, conv_dim),
        z=r(bsz, heads_v * v_dim),
        b=r(bsz, heads_v),
        a=r(bsz, heads_v),
        window=r(bsz, conv_dim, 3),
        conv_w=r(conv_dim, 4, s=0.3),
        a_log=(torch.rand(heads_v, generator=gen) * 16 + 0.01).log(),
        dt_bias=1 + r(heads_v, s=0.1),
        state=r(bsz, heads_v, k_dim, v_dim, s=0.1),
        norm_w=1 + r(v_dim, s=0.05),
    )


@pytest.mark.parametrize(
    "bsz,heads_k,heads_v", [(1, 16, 16), (2, 2, 6)], ids=["0.8b-shape", "grouped-batch2"]
)
def test_fused_gdn_decode_matches_reference_over_steps(
    bsz: int, heads_k: int, heads_v: int
) -> None:
    """The native kernel on pool rows `slots` (the spare row untouched) against the reference."""
    inp = _gdn_inputs(bsz + 1, heads_k, heads_v, 32, 48, seed=heads_v)
    ref_state, state = inp["state"].clone(), inp["state"].clone()
    ref_window, window = inp["window"].clone(), inp["window"].clone()
    slots = torch.arange(bsz, 0, -1)  # rows bsz..1: reversed, row 0 is nobody's
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):  # the windows and states carry across steps
        qkv = torch.randn(inp["qkv"][:bsz].shape, generator=gen)
        args = (inp["z"][:bsz], inp["b"][:bsz], inp["a"][:bsz])
        tail = (inp["conv_w"], inp["a_log"], inp["dt_bias"])
        ref = gdn_decode_slots_ref(qkv, *args, ref_window, *tail, ref_state, slots,
                                   inp["norm_w"], 1e-6, heads_k)
        out = gdn_decode_slots(qkv, *args, window, *tail, state, slots, inp["norm_w"], 1e-6,
                               heads_k)
        assert rel(out, ref) <= 1e-5
    assert rel(state, ref_state) <= 1e-5
    assert torch.allclose(window, ref_window)
    assert torch.equal(state[0], inp["state"][0]) and torch.equal(window[0], inp["window"][0])


@pytest.mark.parametrize("rows,dim,offset", [(1, 1024, 1.0), (37, 256, 1.0), (5, 128, 0.0)])
def test_rmsnorm_matches_reference(rows: int, dim: int, offset: float) -> None:
    from deltaserve.ops.norm import rms_norm, rms_norm_ref

    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(rows, dim, generator=gen) * 3
    w = torch.randn(dim, generator=gen) * 0.1
    assert rel(rms_norm(x, w, 1e-6, offset), rms_norm_ref(x, w, 1e-6, offset)) <= 1e-6


@pytest.mark.parametrize("batch", [2, 3, 5, 16, 37])
@pytest.mark.parametrize(("rows", "cols"), [(7, 64), (203, 1000), (1024, 3584)])
def test_small_batch_gemm_matches_reference(batch: int, rows: int, cols: int) -> None:
    """Rows not a multiple of the 4-row tile, batches not a multiple of 4, K with a scalar tail."""
    torch.manual_seed(batch * rows)
    w = torch.randn(rows, cols).bfloat16()
    x = torch.randn(batch, cols)
    out = gemm_small(x, w)
    assert out.shape == (batch, rows)
    assert rel(out, gemv_ref(x, w)) <= GEMV_BOUND
