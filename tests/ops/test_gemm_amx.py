"""The AMX bf16x2/x3 GEMM (ops/gemm_amx.py, csrc/gemm_amx.c) against its torch reference and
against fp64, on shapes that are not multiples of its 32 blocks, with and without the fused bias,
tanh GELU and residual; its dispatch from the vision tower's linear layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.env import env
from deltaserve.ops import gemm_amx
from tests.isa import needs_amx


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_split_bf16_keeps_16_bits_and_infinities():
    x = torch.randn(4096) * torch.logspace(-20, 20, 4096)
    hi, lo = gemm_amx.split_bf16(x)
    assert hi.dtype == lo.dtype == torch.bfloat16
    err = (hi.double() + lo.double() - x.double()).abs() / x.double().abs()
    assert err.max().item() <= 2.0**-16
    hi, lo = gemm_amx.split_bf16(torch.tensor([float("inf"), -float("inf"), 1.0]))
    assert hi.float().tolist() == [float("inf"), -float("inf"), 1.0] and not lo.float().any()


def test_pack_weight_keeps_a_lo_part_only_for_non_bf16_values():
    w = torch.randn(40, 70)
    assert gemm_amx.pack_weight(w.bfloat16()).lo is None
    assert gemm_amx.pack_weight(w.bfloat16().float()).lo is None
    packed = gemm_amx.pack_weight(w)
    assert packed.lo is not None and packed.hi.shape == (64 // 16, 96 // 32, 16, 32)
    # tile (n/16, k/32), row r, column c, pair j holds W[n, k] with k = 32 kb + 2 r + j
    n, k = 21, 37
    assert packed.hi[n // 16, k // 32, (k % 32) // 2, 2 * (n % 16) + k % 2] == w[n, k].bfloat16()


@needs_amx
@pytest.mark.parametrize("rows,n,k", [(1, 16, 32), (37, 50, 70), (100, 300, 1152), (70, 1152, 4304)])
@pytest.mark.parametrize("weights", ["bf16", "fp32"])
@pytest.mark.parametrize("fused", ["plain", "bias", "gelu+residual"])
def test_gemm_amx_matches_reference_and_fp64(rows, n, k, weights, fused):
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    if weights == "bf16":
        w = w.bfloat16().float()
    bias = torch.randn(n, generator=gen) if fused != "plain" else None
    residual = torch.randn(rows, n, generator=gen) if fused == "gelu+residual" else None
    gelu = fused == "gelu+residual"
    y = gemm_amx.gemm_amx(x, gemm_amx.pack_weight(w), bias, residual, gelu)
    ref = gemm_amx.gemm_amx_ref(x, w, bias, residual, gelu)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert _rel(y, ref) < 1e-6  # same products; fp32 vs fp64 sums, the epilogue's own exp
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    if gelu:
        exact = F.gelu(exact, approximate="tanh")
    if residual is not None:
        exact = exact + residual.double()
    assert _rel(y, exact) < 1e-5  # x's 16 bits: ~2^-17 per term


@needs_amx
def test_gelu_epilogue_over_its_whole_range_and_nan():
    v = torch.cat([torch.linspace(-30, 30, 4001), torch.tensor([-1e4, 1e4, 1e-30, -1e-30, 0.0])])
    v = v.bfloat16().float()  # so that x = hi exactly and the GEMM hands the epilogue v itself
    eye = torch.eye(32)
    x = torch.zeros(v.numel(), 32)
    x[:, 0] = v  # y[:, 0] = v exactly (one product with 1.0)
    y = gemm_amx.gemm_amx(x, gemm_amx.pack_weight(eye), None, None, gelu_tanh=True)[:, 0]
    ref = F.gelu(v.double(), approximate="tanh")
    # relative to the output, plus a term relative to the input: for v < 0 gelu(v) is a small
    # difference (torch's own fp32 GELU is 3e-5 off relative at v = -3.3), in the far tail ~0
    bound = 1e-6 * ref.abs() + 1e-7 * v.double().abs()
    assert ((y.double() - ref).abs() <= bound).all()
    assert ((F.gelu(v, approximate="tanh").double() - ref).abs() <= bound).all()  # torch's too
    x[0, 0] = float("nan")
    assert gemm_amx.gemm_amx(x[:1], gemm_amx.pack_weight(eye), None, None, True)[0, 0].isnan()


@needs_amx
def test_packed_for_repacks_after_an_in_place_write():
    owner = torch.nn.Linear(64, 48)
    with torch.no_grad():
        first = gemm_amx.packed_for(owner, owner.weight)
        assert gemm_amx.packed_for(owner, owner.weight) is first
        owner.weight.mul_(2.0)
        second = gemm_amx.packed_for(owner, owner.weight)
    assert second is not first
    x = torch.randn(40, 64)
    assert _rel(gemm_amx.gemm_amx(x, second), x @ owner.weight.detach().T) < 1e-5


def test_vision_linear_dispatch(monkeypatch):
    """The tower's BiasLinear: the AMX kernel from MIN_ROWS rows where it runs (fp32 within its
    bound of F.linear), F.linear bit for bit below it, with DELTASERVE_AMX=0, or without AMX."""
    from deltaserve.multimodal.siglip import BiasLinear

    layer = BiasLinear(96, 80, torch.float32)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 96).bfloat16())
        layer.bias.copy_(torch.randn(80))
    few, many = torch.randn(gemm_amx.MIN_ROWS - 1, 96), torch.randn(gemm_amx.MIN_ROWS, 96)
    residual = torch.randn(gemm_amx.MIN_ROWS, 80)
    expected = residual + F.gelu(F.linear(many, layer.weight, layer.bias), approximate="tanh")
    assert torch.equal(layer(few), F.linear(few, layer.weight, layer.bias))
    got = layer(many, residual, gelu_tanh=True)
    assert _rel(got, expected) < 1e-5
    assert gemm_amx.available() == (not torch.equal(got, expected))  # which path ran
    monkeypatch.setenv("DELTASERVE_AMX", "0")
    env.cache_clear()
    try:
        assert not gemm_amx.available()
        assert torch.equal(layer(many, residual, gelu_tanh=True), expected)
    finally:
        monkeypatch.delenv("DELTASERVE_AMX")
        env.cache_clear()
