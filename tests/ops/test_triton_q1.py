"""The q1 GEMV on int8 activations (ops/triton_q1) against its spec, ops/qgemv.qgemv_act_ref (on
the GPU; under TRITON_INTERPRET=1 on the CPU too), and its place in quant_linear's dispatch."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import triton_q1
from deltaserve.ops.dispatch import Case
from deltaserve.ops.gemv_prologue import AddNorm, SiluMul, apply_ref
from deltaserve.ops.qgemv import qgemv_act_ref, qgemv_ref
from deltaserve.quant.linear import QUANT_LINEAR
from deltaserve.quant.schemes import FORMATS, Scheme, quantize
from tests.ops.triton_device import KDEV, needs_kernels, rel


def _packed(n: int, k: int, scheme: Scheme, half: bool) -> dict:
    torch.manual_seed(n * 31 + k)
    p = quantize(torch.randn(n, k) * 0.05, scheme)
    dtype = torch.float16 if half else torch.float32  # CUDA models hold fp16 scales
    return {name: (t.to(dtype) if t.is_floating_point() else t).to(KDEV) for name, t in p.items()}


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize(("n", "k", "group"), [(37, 256, 128), (100, 1152, 128), (5, 384, 32),
                                               (64, 5120, 128), (33, 2048, 256)])
@pytest.mark.parametrize("config", [None, (4, 8, 2), (32, 64, 8)])
def test_q1_a8_gemv_matches_the_int8_activation_spec(n, k, group, config) -> None:
    """Odd row counts, groups that cross the K-step's edge, a zero group of x (dx = 0), inputs of
    a row past N: the per-32 integer dots are exact, so only the fp32 sums' order differs."""
    scheme = Scheme("q1", 1, group)
    p = _packed(n, k, scheme, half=KDEV == "cuda")
    x = torch.randn(1, k, device=KDEV)
    x[0, 32:64] = 0.0
    y = triton_q1.q1_gemv_a8_cuda(x, p, scheme, config=config)
    ref = qgemv_act_ref(x.cpu(), {name: t.cpu() for name, t in p.items()}, scheme)
    assert y.shape == (1, n) and y.dtype == x.dtype
    assert rel(y.cpu(), ref) <= 1e-6
    assert 1e-3 < rel(ref, qgemv_ref(x.cpu(), {kk: t.cpu() for kk, t in p.items()}, scheme)) < 2e-2


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("kind", ["norm", "silu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_q1_a8_prologue_is_the_separate_ops_then_the_gemv(kind, dtype) -> None:
    if KDEV != "cuda" and (kind == "norm" or dtype != torch.float32):
        pytest.skip("Triton's interpreter rejects the norm's store mask and truncates bf16 casts")
    n, k = 45, 384
    scheme = FORMATS["q1"]
    p = _packed(n, k, scheme, half=False)
    torch.manual_seed(1)
    if kind == "silu":
        x, prologue, ref_prologue = torch.randn(1, 2 * k, device=KDEV).to(dtype), SiluMul(), SiluMul()
    else:
        x, res = (torch.randn(1, k, device=KDEV).to(dtype) for _ in range(2))
        w = torch.randn(k, device=KDEV) * 0.1
        prologue = AddNorm(res, w, 1e-6, 1.0, torch.empty_like(x))
        ref_prologue = AddNorm(res, w, 1e-6, 1.0, torch.empty_like(x))
    y = triton_q1.q1_gemv_a8_cuda(x, p, scheme, prologue=prologue)
    h = apply_ref(x, ref_prologue)
    assert y.dtype == dtype
    cpu = {name: t.cpu() for name, t in p.items()}  # the spec runs on the CPU
    assert rel(y.float().cpu(), qgemv_act_ref(h.float().cpu(), cpu, scheme)) <= (
        8e-3 if dtype == torch.bfloat16 else 1e-6)
    if kind == "norm":  # program 0 of the activation kernel stores residual + x
        assert torch.equal(prologue.total, ref_prologue.total)


@pytest.mark.parametrize("exact", ["0", "1"])
def test_q1_cuda_rows_take_int8_activations_unless_the_knob_says_exact(exact, monkeypatch) -> None:
    """A CUDA q1 decode row: the int8-activation GEMV (the CPU's and llama.cpp's math) by default,
    the exact fp32 one under DELTASERVE_EXACT_INT8_ACT=1; other kinds never take it."""
    monkeypatch.setenv("DELTASERVE_EXACT_INT8_ACT", exact)
    monkeypatch.setattr(triton_q1, "available", lambda: True)
    q1 = dict(QUANT_LINEAR.explain(Case("cuda", torch.bfloat16, (FORMATS["q1"], True, False, True))))
    assert (q1["triton_q1_a8"] is None) == (exact == "0")
    int8 = dict(QUANT_LINEAR.explain(Case("cuda", torch.bfloat16,
                                          (FORMATS["int8"], True, False, True))))
    assert int8["triton_q1_a8"] == "not a q1 weight"
    cpu = dict(QUANT_LINEAR.explain(Case("cpu", torch.float32, (FORMATS["q1"], True, False, True))))
    assert cpu["triton_q1_a8"] is not None
