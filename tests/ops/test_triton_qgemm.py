"""The Triton int8 decode-batch GEMM against dequantize-then-F.linear (run on the H200; fp32 also
under TRITON_INTERPRET)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops import triton_qgemm
from deltaserve.quant.schemes import FORMATS, Scheme, dequantize, quantize
from tests.ops.triton_device import KDEV, needs_kernels, rel

pytestmark = pytest.mark.gpu


def _case(rows: int, n: int, k: int, dtype, scheme):
    torch.manual_seed(rows * 7 + n)
    packed = {name: (t.float() if t.is_floating_point() else t).to(KDEV)
              for name, t in quantize(torch.randn(n, k), scheme).items()}
    x = torch.randn(rows, k, device=KDEV).to(dtype)
    ref = F.linear(x.float(), dequantize(packed, scheme, torch.float32))
    return x, packed, ref


def _skip_interpreter_bf16(dtype) -> None:
    if KDEV == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 tl.dot wrongly; checked on CUDA")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "n", "k"), [(2, 200, 256), (37, 1024, 384), (128, 96, 1024),
                                              (130, 1000, 3584)])
def test_int8_gemm_matches_dequantize_then_linear(dtype, rows, n, k) -> None:
    _skip_interpreter_bf16(dtype)
    scheme = FORMATS["int8"]
    x, packed, ref = _case(rows, n, k, dtype, scheme)
    out = triton_qgemm.qgemm_cuda(x, packed, scheme)
    assert out.dtype == dtype and out.shape == (rows, n)
    assert rel(out, ref) <= (1e-6 if dtype == torch.float32 else 8e-3)


@needs_kernels
@pytest.mark.parametrize("split", [2, 3, 4, 8])
def test_split_k_sums_every_group_once(split) -> None:
    """Split K with a group count the split does not divide (6 groups over 4 programs: one
    program gets none), tiles narrower than N and rows past a tile."""
    scheme = FORMATS["int8"]
    x, packed, ref = _case(19, 72, 384, torch.float32, scheme)
    config = triton_qgemm.Config(block_m=16, block_n=32, split=split, num_warps=4, num_stages=2)
    out = triton_qgemm.qgemm_cuda(x, packed, scheme, config)
    assert rel(out, ref) <= 1e-6


@needs_kernels
@pytest.mark.parametrize("group", [32, 128])
def test_other_group_sizes(group) -> None:
    scheme = Scheme(kind="int8", bits=8, group_size=group)
    assert triton_qgemm.supports(scheme)
    x, packed, ref = _case(5, 160, 512, torch.float32, scheme)
    assert rel(triton_qgemm.qgemm_cuda(x, packed, scheme), ref) <= 1e-6


def test_launch_config_splits_only_narrow_outputs() -> None:
    """The N = 1024 projections of the 0.8B shape fill under half of 132 SMs: they split K;
    the wide ones do not. Plain arithmetic, no kernel."""
    if triton_qgemm.triton is None:
        pytest.skip("needs Triton")
    for rows in (2, 8, 32, 128, 256):
        for n in (8224, 5120, 248320):
            assert triton_qgemm.launch_config(rows, n, 1024, 64).split == 1
        narrow = triton_qgemm.launch_config(rows, 1024, 3584, 64)
        assert narrow.split >= 2 and (3584 // 64) // narrow.split >= 4
    assert not triton_qgemm.supports(Scheme(kind="int8", bits=8, group_size=8))
