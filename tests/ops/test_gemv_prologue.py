"""GEMVs that compute the MLP's add + RMSNorm or silu * mul themselves (ops/gemv_prologue), against
the separate ops followed by the same GEMV (same launch config) on their output. Kernel cases run on
the H200; under TRITON_INTERPRET=1 on CPU only the fp32 ones agree (the interpreter truncates
fp32 -> bf16 casts where the separate ops round). The fallback of a layer without a fused kernel
runs everywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.layers.linear import Linear
from deltaserve.layers.mlp import MLP
from deltaserve.layers.norm import RMSNorm
from deltaserve.ops import triton_gemv, triton_qgemv
from deltaserve.ops.gemv_prologue import AddNorm, SiluMul, apply_ref, check
from deltaserve.ops.qgemv import qgemv_ref
from deltaserve.quant.schemes import FORMATS, quantize
from tests.ops.triton_device import KDEV, needs_kernels, rel


def _prologue(kind: str, k: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, object]:
    """A fresh input row and prologue: AddNorm (addend, residual, norm weight) or SiluMul."""
    if kind == "silu":
        return torch.randn(1, 2 * k, device=device).to(dtype), SiluMul()
    residual = torch.randn(1, k, device=device).to(dtype) * 3
    weight = torch.randn(k, device=device) * 0.2  # zero-centred: the kernel reads 1 + w
    return torch.randn(1, k, device=device).to(dtype), AddNorm(
        residual, weight, 1e-6, 1.0, torch.empty_like(residual))


def _reference(x, prologue):
    """The separate ops: the GEMV input and (AddNorm) the residual sum they write."""
    if isinstance(prologue, AddNorm):
        ref = AddNorm(prologue.residual, prologue.weight, prologue.eps, prologue.offset,
                      torch.empty_like(prologue.total))
        return apply_ref(x, ref), ref.total
    return apply_ref(x, prologue), None


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("kind", ["norm", "silu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("rows", "cols", "config"),
                         [(37, 384, None), (300, 1024, (2, 1024, 4, 1, 1)),
                          (64, 640, (4, 256, 4, 1, 3))])  # split K over 3
def test_dense_gemv_prologue_matches_the_separate_ops(kind, dtype, rows, cols, config) -> None:
    torch.manual_seed(rows + cols)
    weight = torch.randn(rows, cols, device=KDEV).to(dtype)
    x, prologue = _prologue(kind, cols, dtype, KDEV)
    h, total = _reference(x, prologue)
    out = triton_gemv.gemv16_cuda(x, weight, config, prologue=prologue)
    assert out.dtype == dtype
    assert rel(out, F.linear(h.float(), weight.float())) <= (8e-3 if dtype == torch.bfloat16 else 1e-5)
    _assert_as_separate(out, triton_gemv.gemv16_cuda(h, weight, config), prologue, total, dtype)


def _assert_as_separate(out, unfused, prologue, total, dtype) -> None:
    """The fused GEMV against the same GEMV on the separate ops' output: on the GPU the separate
    silu*mul is the Triton kernel of the same expression, so in bf16 (x rounded to 16 bits before
    the dot product) the same x bits and the same y bits; in fp32 the two compiled kernels may
    contract multiply-adds differently (seen on the H200: fp32 int4, one last-bit difference), so
    fp32 within 1e-6. AddNorm's rstd may be reduced in another order (a last-bit difference that
    can move one bf16 element of x by an ulp), and its sum is bit-identical. On the CPU
    (interpreter) the separate ops are torch's, whose silu rounds otherwise: fp32 within 1e-6."""
    if KDEV != "cuda" and dtype != torch.float32:
        return  # the interpreter's truncating bf16 casts (module docstring)
    if isinstance(prologue, SiluMul):
        if KDEV == "cuda" and dtype == torch.bfloat16:
            assert torch.equal(out, unfused)
        else:
            assert rel(out, unfused) <= 1e-6
    else:
        assert rel(out, unfused) <= (2e-3 if dtype == torch.bfloat16 else 1e-6)
        assert torch.equal(prologue.total, total)  # the residual stream: the same bits


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("kind", ["norm", "silu"])
@pytest.mark.parametrize("fmt", ["int8", "int4", "q1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_packed_gemv_prologue_matches_the_separate_ops(kind, fmt, dtype) -> None:
    rows, cols = 45, 384
    torch.manual_seed(cols)
    scheme = FORMATS[fmt]
    packed = {k: (v.float() if v.is_floating_point() else v).to(KDEV)
              for k, v in quantize(torch.randn(rows, cols), scheme).items()}
    x, prologue = _prologue(kind, cols, dtype, KDEV)
    h, total = _reference(x, prologue)
    out = triton_qgemv.qgemv_cuda(x, packed, scheme, prologue=prologue)
    assert rel(out, qgemv_ref(h.float(), packed, scheme)) <= (8e-3 if dtype == torch.bfloat16 else 1e-5)
    _assert_as_separate(out, triton_qgemv.qgemv_cuda(h, packed, scheme), prologue, total, dtype)


def test_a_layer_without_a_fused_kernel_runs_the_separate_ops_first() -> None:
    """CPU rows (no Triton GEMV): the prologue runs as the separate ops, then the layer's own
    GEMV, and AddNorm's sum still lands in .total."""
    torch.manual_seed(0)
    lin = Linear(96, 40, torch.float32)
    lin.weight.copy_(torch.randn(40, 96))
    x, prologue = _prologue("norm", 96, torch.float32, "cpu")
    assert not lin.fuses_prologue(x)
    h, total = _reference(x, prologue)
    assert torch.equal(lin(x, prologue), F.linear(h, lin.weight))
    assert torch.equal(prologue.total, total)
    mlp = MLP(96, 64, torch.float32)
    for p in mlp.parameters():
        p.copy_(torch.randn_like(p) * 0.1)
    norm = RMSNorm(96, 1e-6)
    norm.weight.copy_(torch.randn(96) * 0.1)
    fused = norm.add_prologue(prologue.residual)
    h2, total2 = norm.add_forward(x, prologue.residual)
    assert torch.equal(mlp(x, fused), mlp(h2))
    assert torch.equal(fused.total, total2)


def test_prologue_shape_mismatches_are_named() -> None:
    x = torch.zeros(1, 64)
    with pytest.raises(ValueError, match="SiluMul"):
        check(x, SiluMul(), 64)  # a gate|up row is twice the GEMV's K
    with pytest.raises(ValueError, match="residual"):
        check(x, AddNorm(torch.zeros(1, 32), torch.zeros(64), 1e-6, 1.0, torch.zeros(1, 64)), 64)
    with pytest.raises(ValueError, match="total"):
        check(x, AddNorm(torch.zeros(1, 64), torch.zeros(64), 1e-6, 1.0,
                         torch.zeros(1, 64, dtype=torch.bfloat16)), 64)
