"""The dense Triton decode GEMV against F.linear on fp32 copies, and linear()'s dispatch to it (run on
the H200; also under TRITON_INTERPRET, on smaller shapes: the interpreter runs programs one by one)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.env import env
from deltaserve.layers.linear import linear
from deltaserve.ops import triton_gemv
from tests.ops.triton_device import KDEV, needs_kernels, rel

pytestmark = pytest.mark.gpu

# (N, K): tiny, the 0.8B GDN in-projection's q|k|v rows, MLP down, K off every block size. On the
# interpreter a long-K / few-rows stand-in (split-K's case) replaces the two model shapes.
SHAPES = [(37, 384), (300, 200)] + (
    [(6144, 1024), (1024, 3584)] if KDEV == "cuda" else [(24, 1500)])
# (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K); the last one's second split is empty for
# K <= 512 (its slice of K starts past the end)
CONFIGS = [None, (8, 128, 4, 2, 1), (16, 64, 2, 1, 3), (4, 512, 8, 1, 2)]
# (x dtype, weight dtype, rel tolerance): fp32 output keeps the exact fp32 math; 16-bit outputs
# round once (the interpreter truncates to bf16 where CUDA rounds to nearest: still < 8e-3)
DTYPES = [pytest.param(torch.float32, torch.float32, 1e-5, id="fp32"),
          pytest.param(torch.float32, torch.bfloat16, 1e-5, id="fp32-x-bf16-w"),
          pytest.param(torch.bfloat16, torch.bfloat16, 8e-3, id="bf16"),
          pytest.param(torch.float16, torch.float16, 1e-3, id="fp16")]


@needs_kernels
@pytest.mark.parametrize(("x_dtype", "w_dtype", "tol"), DTYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("config", CONFIGS)
def test_gemv16_matches_fp32_linear(x_dtype, w_dtype, tol, n, k, config) -> None:
    torch.manual_seed(n + k)
    weight = torch.randn(n, k, device=KDEV).to(w_dtype)
    x = torch.randn(1, k, device=KDEV).to(x_dtype)
    out = triton_gemv.gemv16_cuda(x, weight, config)
    assert out.dtype == x_dtype and out.shape == (1, n)
    assert rel(out, F.linear(x.float(), weight.float())) <= tol


@needs_kernels
def test_gemv16_rejects_more_than_one_row() -> None:
    weight = torch.randn(8, 64, device=KDEV)
    with pytest.raises(ValueError, match="must be"):
        triton_gemv.gemv16_cuda(torch.randn(2, 64, device=KDEV), weight)


def test_config_for_finds_the_window_holding_the_rows(monkeypatch) -> None:
    a, b = (8, 512, 4, 1, 1), (2, 1024, 8, 1, 4)
    monkeypatch.setattr(triton_gemv, "TUNED", {(1024, 0, 4096): a, (1024, 4096, 8192): b})
    assert triton_gemv.config_for(4095, 1024) == a
    assert triton_gemv.config_for(4096, 1024) == b
    assert triton_gemv.config_for(8192, 1024) is None
    assert triton_gemv.config_for(100, 2048) is None


@pytest.fixture
def kernel_calls(monkeypatch) -> list[tuple[int, int]]:
    """The weight shapes gemv16_cuda was called with (it still computes)."""
    calls: list[tuple[int, int]] = []
    real = triton_gemv.gemv16_cuda

    def spy(x, weight, config=None, prologue=None):
        calls.append(tuple(weight.shape))
        return real(x, weight, config, prologue=prologue)

    monkeypatch.setattr(triton_gemv, "gemv16_cuda", spy)
    return calls


def tune(monkeypatch, n: int, k: int) -> None:
    monkeypatch.setattr(triton_gemv, "TUNED", {(k, n, n + 1): (8, 256, 4, 1, 1)})


cuda_only = pytest.mark.skipif(KDEV != "cuda", reason="linear() routes only CUDA tensors")


@cuda_only
@pytest.mark.parametrize("lead", [(1,), (1, 1)])
def test_linear_routes_a_tuned_decode_row_to_the_kernel(monkeypatch, kernel_calls, lead) -> None:
    torch.manual_seed(1)
    weight = torch.randn(1000, 512, device=KDEV).bfloat16()
    x = torch.randn(*lead, 512, device=KDEV).bfloat16()
    tune(monkeypatch, 1000, 512)
    out = linear(x, weight)
    assert kernel_calls == [(1000, 512)]
    assert out.dtype == torch.bfloat16 and out.shape == (*lead, 1000)
    assert rel(out, F.linear(x.float(), weight.float())) <= 8e-3


@cuda_only
def test_linear_keeps_f_linear_outside_tuned_shapes(monkeypatch, kernel_calls) -> None:
    torch.manual_seed(2)
    weight = torch.randn(1000, 512, device=KDEV).bfloat16()
    x = torch.randn(1, 512, device=KDEV).bfloat16()
    assert torch.equal(linear(x, weight), F.linear(x, weight))  # nothing tuned
    tune(monkeypatch, 1001, 512)  # a window that misses this weight by one row
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    tune(monkeypatch, 1000, 512)
    x2 = torch.randn(2, 512, device=KDEV).bfloat16()
    assert torch.equal(linear(x2, weight), F.linear(x2, weight))  # two rows: a GEMM
    x32 = x.float()
    assert torch.equal(linear(x32, weight.float()), F.linear(x32, weight.float()))
    monkeypatch.setenv("DELTASERVE_REFERENCE_OPS", "1")
    env.cache_clear()
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    assert kernel_calls == []


def test_linear_keeps_cpu_tensors_off_the_kernel(monkeypatch, kernel_calls) -> None:
    """Even inside a tuned window the CPU path is the one it was (bit-identical)."""
    torch.manual_seed(3)
    weight = torch.randn(64, 96).bfloat16()
    x = torch.randn(1, 96).bfloat16()
    tune(monkeypatch, 64, 96)
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    assert kernel_calls == []
