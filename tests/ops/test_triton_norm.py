"""Triton RMSNorms against the torch references (run on the H200)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import triton_norm
from deltaserve.ops.norm import add_rms_norm_ref, gated_rms_norm_ref, rms_norm_ref
from tests.ops.triton_device import KDEV, needs_kernels

pytestmark = pytest.mark.gpu


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.skipif(not triton_norm.available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "dim", "offset"), [(1, 1024, 1.0), (37, 256, 1.0), (5, 100, 0.0)])
def test_triton_rms_norm_matches_reference(dtype, rows, dim, offset) -> None:
    torch.manual_seed(rows)
    x = (torch.randn(rows, dim, device="cuda") * 3).to(dtype)
    w = torch.randn(dim, device="cuda") * 0.1
    out, ref = triton_norm.rms_norm_cuda(x, w, 1e-6, offset), rms_norm_ref(x, w, 1e-6, offset)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert rel(out, ref) <= (1e-6 if dtype == torch.float32 else 8e-3)


@pytest.mark.skipif(not triton_norm.available(), reason="needs CUDA and Triton")
def test_triton_gated_norm_matches_reference() -> None:
    torch.manual_seed(0)
    x, z = torch.randn(6, 16, 128, device="cuda"), torch.randn(6, 16, 128, device="cuda")
    w = torch.rand(128, device="cuda") + 0.5
    out, ref = triton_norm.gated_rms_norm_cuda(x, z, w, 1e-6), gated_rms_norm_ref(x, z, w, 1e-6)
    assert out.dtype == torch.float32 and rel(out, ref) <= 1e-6


@pytest.mark.skipif(not triton_norm.available(), reason="needs CUDA and Triton")
def test_triton_gated_norm_reads_a_strided_gate_view() -> None:
    torch.manual_seed(1)
    x = torch.randn(6, 16, 128, device="cuda")
    proj = torch.randn(6, 16 * 128 + 40, device="cuda")
    z = proj[:, 3 : 3 + 16 * 128]  # row stride 2088, unit column stride
    w = torch.rand(128, device="cuda") + 0.5
    out = triton_norm.gated_rms_norm_cuda(x, z, w, 1e-6)
    ref = gated_rms_norm_ref(x, z.reshape(6, 16, 128), w, 1e-6)
    assert rel(out, ref) <= 1e-6


@pytest.mark.skipif(not triton_norm.available(), reason="needs CUDA and Triton")
def test_gated_norm_of_a_bf16_model_prefill_is_one_kernel_rounded_once() -> None:
    """The bf16 model's prefill: fp32 scan output, bf16 gate view, 90 tokens x 16 heads (over
    CUDA_MAX_ROWS): the Triton kernel, bf16 out, against the reference rounded to bf16."""
    from deltaserve.ops.norm import gated_rms_norm

    torch.manual_seed(2)
    x = torch.randn(1, 90, 16, 128, device="cuda")
    proj = torch.randn(90, 16 * 128 + 48, device="cuda").bfloat16()
    z = proj[:, 16 : 16 + 16 * 128]
    w = torch.rand(128, device="cuda") + 0.5
    out = gated_rms_norm(x, z, w, 1e-6, torch.bfloat16)
    ref = gated_rms_norm_ref(x, z.reshape(x.shape), w, 1e-6).bfloat16()
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert (out.float() != ref.float()).float().mean().item() < 1e-3  # fp32 op order only
    assert rel(out, ref) <= 4e-3


@needs_kernels
@pytest.mark.parametrize(("gated", "dim"), [(True, 128), (False, 128), (False, 1024)])
def test_many_row_norm_kernel_matches_reference(gated, dim) -> None:
    """A long prefill's norms (MANY_ROWS rows and more; 16 rows of 128 or 2 of 1,024 per program,
    a partial last program): fp32 within 1e-6 of the references; the gate read in place from a
    strided projection view."""
    rows = triton_norm.MANY_ROWS + 37
    torch.manual_seed(rows)
    x = torch.randn(rows, dim, device=KDEV) * 3
    w = torch.rand(dim, device=KDEV) + 0.5
    if gated:
        proj = torch.randn(rows, 128 + 24, device=KDEV)  # one head per row, row stride 152
        z = proj[:, 8 : 8 + 128]
        out = triton_norm.gated_rms_norm_cuda(x, z, w, 1e-6)
        ref = gated_rms_norm_ref(x, z.contiguous(), w, 1e-6)
    else:
        out, ref = triton_norm.rms_norm_cuda(x, w, 1e-6, 1.0), rms_norm_ref(x, w, 1e-6, 1.0)
    assert out.shape == ref.shape and rel(out, ref) <= 1e-6


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_add_rms_norm_matches_reference(dtype) -> None:
    torch.manual_seed(3)
    x = (torch.randn(1, 7, 1024, device=KDEV) * 3).to(dtype)
    res = (torch.randn(1, 7, 1024, device=KDEV) * 3).to(dtype)
    w = torch.randn(1024, device=KDEV) * 0.1
    normed, total = triton_norm.add_rms_norm_cuda(x, res, w, 1e-6, 1.0)
    ref_normed, ref_total = add_rms_norm_ref(x, res, w, 1e-6, 1.0)
    if KDEV == "cuda":  # the residual stream is the plain sum, rounded once (the interpreter
        assert torch.equal(total, ref_total)  # rounds fp32 -> bf16 toward zero: within an ulp)
    assert rel(total, ref_total) <= (0 if dtype == torch.float32 else 8e-3)
    assert normed.dtype == dtype and rel(normed, ref_normed) <= (1e-6 if dtype == torch.float32
                                                                 else 8e-3)
