"""The word-wise Q4_K / Q6_K GEMVs (ops/triton_kquants) against dequantize_blocks then a float64
GEMV, on fresh random blocks: every launch shape family (rows and blocks per program, a K-step
shorter and longer than K, rows not a multiple of BLOCK_N), K not a power of two, both nibble
conversions, the fused prologues and PDL. On the GPU, or on the CPU under TRITON_INTERPRET=1
(no inline PTX there: the plain conversion, no prologue)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.gemv_prologue import AddNorm, SiluMul, apply_ref
from deltaserve.quant.ggml_blocks import dequantize_blocks
from tests.ops.test_blocks import blocks_of
from tests.ops.triton_device import KDEV, needs_kernels, rel

pytestmark = needs_kernels
ON_GPU = KDEV == "cuda"


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
@pytest.mark.parametrize("k", [1024, 1792])
@pytest.mark.parametrize("config", [(8, 4, 4), (4, 1, 2), (16, 8, 4), (32, 2, 8)])
def test_kquant_gemv_matches_the_reference(kind, k, config) -> None:
    from deltaserve.ops import triton_kquants

    w = blocks_of(kind, 45, k, seed=k + config[0]).to(KDEV)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(config[1])).to(KDEV)
    want = x.double() @ dequantize_blocks(w, kind).double().T
    for magic in (True, False) if ON_GPU else (False,):
        y = triton_kquants.gemv_kquant_cuda(x, w, kind, config=config, magic=magic)
        assert y.shape == (1, 45) and y.dtype == torch.float32
        assert rel(y, want) <= 1e-6, (magic, rel(y, want))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the prologue's program-0 store needs the GPU")
@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
@pytest.mark.parametrize("prologue", ["addnorm", "silumul"])
@pytest.mark.parametrize("pdl", [0, 1, 2])
def test_kquant_prologue_is_the_separate_ops_then_the_gemv(kind, prologue, pdl) -> None:
    from deltaserve.ops import triton_kquants

    k = 1024
    w = blocks_of(kind, 77, k, seed=3).to(KDEV)
    if prologue == "silumul":
        x, pro, ref_pro = torch.randn(1, 2 * k, device=KDEV).bfloat16(), SiluMul(), SiluMul()
    else:
        x = torch.randn(1, k, device=KDEV).bfloat16()
        res, nw = torch.randn_like(x), (torch.randn(k, device=KDEV) * 0.1).bfloat16()
        pro = AddNorm(res, nw, 1e-6, 1.0, torch.empty_like(x))
        ref_pro = AddNorm(res, nw, 1e-6, 1.0, torch.empty_like(x))
    y = triton_kquants.gemv_kquant_cuda(x, w, kind, pdl=pdl, prologue=pro)
    h = apply_ref(x, ref_pro)
    assert rel(y, h.double() @ dequantize_blocks(w, kind).double().T) <= 8e-3
    if prologue == "addnorm":
        assert torch.equal(pro.total, ref_pro.total)


def test_kquant_gemv_refuses_a_mismatched_weight() -> None:
    from deltaserve.ops import triton_kquants

    w = blocks_of("q4_k", 4, 512, seed=0).to(KDEV)
    with pytest.raises(ValueError, match="q4_k GEMV"):
        triton_kquants.gemv_kquant_cuda(torch.randn(1, 768, device=KDEV), w, "q4_k")
