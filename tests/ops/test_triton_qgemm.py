"""The Triton int8 decode-batch GEMM against dequantize-then-F.linear (run on the H200; fp32 also
under TRITON_INTERPRET)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops import triton_qgemm
from deltaserve.quant.schemes import FORMATS, dequantize, quantize
from tests.ops.triton_device import KDEV, needs_kernels, rel

pytestmark = pytest.mark.gpu


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "n", "k"), [(2, 200, 256), (37, 1024, 384), (128, 96, 1024)])
def test_int8_gemm_matches_dequantize_then_linear(dtype, rows, n, k) -> None:
    if KDEV == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 tl.dot wrongly; checked on CUDA")
    torch.manual_seed(rows)
    scheme = FORMATS["int8"]
    packed = {name: (t.float() if t.is_floating_point() else t).to(KDEV)
              for name, t in quantize(torch.randn(n, k), scheme).items()}
    x = torch.randn(rows, k, device=KDEV).to(dtype)
    out = triton_qgemm.qgemm_cuda(x, packed, scheme)
    ref = F.linear(x.float(), dequantize(packed, scheme, dtype).float())
    assert out.dtype == dtype and out.shape == (rows, n)
    assert rel(out, ref) <= (1e-6 if dtype == torch.float32 else 8e-3)
