"""Quantized decode GEMVs against dequantize-then-F.linear, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.native import native_lib
from deltaserve.ops.qgemv import dequantize_into, qgemv, qgemv_ref
from deltaserve.quant.schemes import FORMATS, Scheme, dequantize, quantize

SCHEMES = {**FORMATS, "int8-g32": Scheme("int8", 8, 32), "affine8": Scheme("affine", 8, 64)}


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize(("rows", "cols"), [(1, 128), (37, 384), (203, 896), (1000, 1024)])
def test_qgemv_matches_the_reference(name, rows, cols) -> None:
    scheme = SCHEMES[name]
    torch.manual_seed(rows + cols)
    packed = {k: v.float() if v.is_floating_point() else v
              for k, v in quantize(torch.randn(rows, cols), scheme).items()}
    x = torch.randn(1, cols)
    out, ref = qgemv(x, packed, scheme), qgemv_ref(x, packed, scheme)
    assert out.shape == (1, rows)
    # fp32 sums in another order: bounded by the size of the terms, not of their (cancelling) sum
    dense = dequantize(packed, scheme)
    magnitude = torch.nn.functional.linear(x.abs(), dense.abs())
    assert ((out - ref).abs() <= 1e-6 * magnitude + 1e-7).all()
    if rows > 1:  # one output can cancel to near zero; many cannot all do so
        assert ((out - ref).norm() / ref.norm()).item() <= 1e-4


def test_native_quantized_kernels_are_built_here() -> None:
    """CI has a compiler: the parity test above must exercise the C kernels, not the fallback."""
    lib = native_lib()
    assert lib is not None and all(hasattr(lib, f) for f in ("ds_gemv_q8", "ds_gemv_a4", "ds_gemv_q1"))


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_native_dequantizer_matches_the_reference(name) -> None:
    scheme = SCHEMES[name]
    torch.manual_seed(7)
    packed = {k: v.float() if v.is_floating_point() else v
              for k, v in quantize(torch.randn(203, 896), scheme).items()}
    ref = dequantize(packed, scheme)
    out = dequantize_into(packed, scheme, torch.empty(203, 896))
    # the C path may fuse q*s + b into one FMA: at most one rounding apart
    assert torch.allclose(out, ref, rtol=2e-7, atol=1e-9)
    assert not torch.equal(out, torch.zeros_like(out))
