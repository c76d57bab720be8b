"""Triton quantized GEMVs against dequantize-then-F.linear on a CUDA GPU (run on the H200)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import triton_qgemv
from deltaserve.ops.qgemv import qgemv_ref
from deltaserve.quant.schemes import FORMATS, quantize
from tests.ops.triton_device import KDEV, needs_kernels

pytestmark = pytest.mark.gpu


@needs_kernels
@pytest.mark.parametrize("fmt", ["int8", "int4", "q1"])
@pytest.mark.parametrize(("rows", "cols"), [(37, 384), (6144, 1024), (1024, 3584)])
# the last entry of a config is MAGIC: 0 int-to-float, 1 the 2**23 mantissa trick, 2 the same
# built by byte permutes (inline PTX prmt: int8 and int4), 4 int4 nibbles as 0.5 + n / 32 (int8
# reads 4 as 2)
@pytest.mark.parametrize("config", [None, (1, 1024, 1, 1, 0), (8, 256, 4, 2, 1), (32, 128, 8, 3, 1),
                                    (8, 256, 4, 2, 2), (16, 1024, 4, 1, 2), (8, 256, 4, 2, 4),
                                    (16, 1024, 4, 1, 4)])
def test_triton_qgemv_matches_the_reference(fmt, rows, cols, config) -> None:
    torch.manual_seed(rows)
    scheme = FORMATS[fmt]
    packed = {k: (v.float() if v.is_floating_point() else v).to(KDEV)
              for k, v in quantize(torch.randn(rows, cols), scheme).items()}
    x = torch.randn(1, cols, device=KDEV)
    out, ref = triton_qgemv.qgemv_cuda(x, packed, scheme, config), qgemv_ref(x, packed, scheme)
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-5


@needs_kernels
@pytest.mark.parametrize("config", [(16, 1024, 4, 1, 2), (16, 1024, 4, 1, 4), (8, 4096, 8, 1, 4)])
def test_int4_half_nibbles_hold_on_an_offset_x(config) -> None:
    """MAGIC 4 takes sum(x) / 2 off each group's sum((0.5 + n / 32) x): an x far from zero mean
    (every element near 100) makes that subtraction cancel most of the sum; rows of one repeated code
    are checked against the sum of |x| as well."""
    torch.manual_seed(7)
    scheme = FORMATS["int4"]
    w = torch.randn(333, 3584)
    w[:5] = 0.0  # constant rows: every code equal, so sum(n x) is one code times sum(x)
    packed = {k: (v.float() if v.is_floating_point() else v).to(KDEV)
              for k, v in quantize(w, scheme).items()}
    x = 100.0 + torch.randn(1, 3584, device=KDEV)
    out, ref = triton_qgemv.qgemv_cuda(x, packed, scheme, config), qgemv_ref(x, packed, scheme)
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-5
    assert ((out[0, :5] - ref[0, :5]).abs().max() / x.abs().sum()).item() <= 1e-6


@needs_kernels
@pytest.mark.parametrize("fmt", ["int8", "int4", "q1"])
def test_qgemv_keeps_a_16_bit_activation_dtype(fmt) -> None:
    """bf16 x in, bf16 y out: the fp32 math happens inside the kernel, no cast kernels around it."""
    torch.manual_seed(4)
    scheme = FORMATS[fmt]
    packed = {k: (v.float() if v.is_floating_point() else v).to(KDEV)
              for k, v in quantize(torch.randn(300, 256), scheme).items()}
    x = torch.randn(1, 256, device=KDEV).to(torch.bfloat16)
    out = triton_qgemv.qgemv_cuda(x, packed, scheme)
    ref = qgemv_ref(x.float(), packed, scheme)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).norm() / ref.norm()).item() <= 8e-3
