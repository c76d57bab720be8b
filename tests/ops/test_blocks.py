"""GGUF block kernels against the torch reference (quant/ggml_blocks.dequantize_blocks, itself
checked bit for bit against the gguf package in tests/quant): the native CPU decoders exact, the
native multi-row GEMM and the Triton GEMV (on the H200) within fp32 rounding, on fresh random
blocks of every kind, odd row counts and several blocks per row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltaserve.env import env
from deltaserve.ops.native import isa_paths, native_lib
from deltaserve.quant.ggml_blocks import BLOCKS, dequantize_blocks
from deltaserve.quant.schemes import Scheme
from tests.ops.triton_device import KDEV, needs_kernels, rel

# byte offsets of each kind's fp16 scales: set small and finite (random bytes may be inf / NaN)
SCALES_AT = {"q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
             "iq4_xs": (0,), "iq4_nl": (0,), "q5_0": (0,), "q5_1": (0, 2)}

needs_native = pytest.mark.skipif(native_lib() is None, reason="no C compiler for the kernels")


def blocks_of(kind: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    _, qk, nbytes, _ = BLOCKS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // qk, nbytes), dtype=np.uint8)
    for at in SCALES_AT[kind]:
        scale = rng.uniform(0.002, 0.02, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])
        raw[:, :, at:at + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


@needs_native
@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_native_decoders_equal_the_reference(kind) -> None:
    from deltaserve.ops.qgemv import dequantize_into

    w = blocks_of(kind, 7, 512, seed=len(kind))
    out = torch.empty(7, 512)
    dequantize_into({"weight": w}, Scheme(kind, BLOCKS[kind][3], BLOCKS[kind][1]), out)
    assert torch.equal(out, dequantize_blocks(w, kind))


@pytest.fixture(params=["exact", "int8 activations"])
def activations(request, monkeypatch):
    """Both block GEMMs: fp32 activations (DELTASERVE_EXACT_INT8_ACT=1), and the int8-activation
    kernels where this build has them (else the same exact ones)."""
    monkeypatch.setenv("DELTASERVE_EXACT_INT8_ACT", "1" if request.param == "exact" else "0")
    env.cache_clear()
    yield request.param
    env.cache_clear()


@needs_native
@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_native_gemm_matches_the_reference_and_rows_keep_their_bits(kind, activations) -> None:
    from deltaserve.ops.qgemv import blocks_act_ref, blocks_vnni, gemm_blocks

    scheme = Scheme(kind, BLOCKS[kind][3], BLOCKS[kind][1])
    w = blocks_of(kind, 37, 768, seed=7 + len(kind))
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(3))
    x[1, 40:70] = 0.0  # a group of zeros: its step is zero, not NaN
    y = gemm_blocks(x, {"weight": w}, scheme)
    int8 = blocks_vnni(native_lib(), scheme)
    assert int8 == (activations != "exact" and kind in ("q4_k", "q5_k", "q6_k", "iq4_xs") and
                    "int8-blocks" in isa_paths())
    want = blocks_act_ref(x, {"weight": w}, scheme) if int8 else \
        x.double() @ dequantize_blocks(w, kind).double().T
    assert rel(y, want) <= 1e-6
    if int8:  # the rounding of x shows against the exact weights times the exact x
        assert 1e-4 < rel(y, x.double() @ dequantize_blocks(w, kind).double().T) < 0.02
    for r in range(5):  # one row alone gives the bits it had among five
        assert torch.equal(gemm_blocks(x[r:r + 1], {"weight": w}, scheme)[0], y[r])


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k", "iq4_xs"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_gemv_matches_the_reference(kind, rows, dtype) -> None:
    """fp32 math on x in its own dtype; y in x's dtype (bf16: one rounding of the fp32 sum)."""
    from deltaserve.ops import triton_blocks

    w = blocks_of(kind, 45, 1024, seed=11 + rows).to(KDEV)
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows)).to(KDEV).to(dtype)
    y = triton_blocks.gemv_blocks_cuda(x, w, kind)
    want = x.double() @ dequantize_blocks(w, kind).double().T
    assert y.shape == (rows, 45) and y.dtype == dtype
    assert rel(y, want) <= (1e-6 if dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k", "iq4_xs", "q2_k", "q8_0"])
def test_every_cuda_verifier_of_a_block_linear_answers(kind, monkeypatch) -> None:
    """quant_linear's dispatch on a CUDA decode row of a block layout asks each Triton kernel
    module (supports, available): every verifier must answer, and the block GEMV take the kinds
    it reads when the backend is on (a missing `supports` once failed only on the GPU)."""
    from deltaserve.ops import triton_blocks
    from deltaserve.ops.dispatch import Case
    from deltaserve.quant.linear import QUANT_LINEAR
    from deltaserve.quant.schemes import Scheme

    scheme = Scheme(kind, BLOCKS[kind][3], BLOCKS[kind][1]) if kind != "q8_0" else \
        Scheme("int8", 8, 32)
    monkeypatch.setattr(triton_blocks, "available", lambda: True)
    why = dict(QUANT_LINEAR.explain(Case("cuda", torch.bfloat16, (scheme, True, False, True))))
    assert (why["triton_blocks"] is None) == (kind in triton_blocks.KINDS)
