"""The fused Triton greedy head (head GEMV + tile argmax) against argmax of fp32 logits (run on
the H200; also under TRITON_INTERPRET for fp32 weights)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops import triton_head
from deltaserve.quant.schemes import FORMATS, dequantize, quantize
from tests.ops.triton_device import KDEV, needs_kernels

pytestmark = pytest.mark.gpu


def assert_argmax_tokens(tokens: torch.Tensor, logits: torch.Tensor, tol: float) -> None:
    """Each token's logit is the row maximum (up to tol: rounding may reorder near-ties); with
    the random weights here every row's top two are further apart, so the tokens are exact."""
    best = logits.max(dim=-1).values
    assert tokens.dtype == torch.int64
    assert (logits.gather(1, tokens[:, None].cpu())[:, 0] >= best - tol * best.abs()).all()
    assert torch.equal(tokens.cpu(), logits.argmax(-1))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_dense_greedy_head_matches_fp32_argmax(dtype, rows) -> None:
    if KDEV == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 tl.dot wrongly; checked on CUDA")
    torch.manual_seed(rows)
    weight = torch.randn(5003, 256).to(dtype)  # not a multiple of the tile
    h = torch.randn(rows, 256).to(dtype)
    tokens = triton_head.greedy_dense_cuda(h.to(KDEV), weight.to(KDEV))
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    assert_argmax_tokens(tokens, F.linear(h.float(), weight.float()), tol)


@needs_kernels
def test_dense_greedy_head_tie_keeps_the_first_index() -> None:
    weight = torch.randn(5003, 256)
    weight[4500] = weight[200]  # different tiles
    weight[201] = weight[200]  # same tile
    h = weight[200:201] * 10
    assert triton_head.greedy_dense_cuda(h.to(KDEV), weight.to(KDEV)).tolist() == [200]


@needs_kernels
@pytest.mark.parametrize("fmt", ["int8", "int4", "q1"])
def test_packed_greedy_head_matches_fp32_argmax(fmt) -> None:
    torch.manual_seed(2)
    scheme = FORMATS[fmt]
    packed = quantize(torch.randn(5003, 128), scheme)
    head = SimpleNamespace(scheme=scheme, in_cols=128, **{
        k: (v.float() if v.is_floating_point() else v).to(KDEV) for k, v in packed.items()})
    h = torch.randn(3, 128)
    tokens = triton_head.greedy_packed_cuda(h.to(KDEV), head)
    weight = dequantize({k: v.cpu() for k, v in vars(head).items() if k in packed}, scheme,
                        torch.float32)
    assert_argmax_tokens(tokens, F.linear(h, weight), 1e-5)


@needs_kernels
def test_int4_vocabulary_head_takes_the_greedy_table_and_stays_exact() -> None:
    """A head in TUNED_ARGMAX's window (K 1024, >= 16384 rows; fp16 scales, bf16 h as the engine
    holds them) runs the greedy table's tile, not the sampling head's, and its tokens are the
    argmax of the fp32 logits; rows end in a partial tile."""
    from deltaserve.ops import triton_qgemv

    torch.manual_seed(3)
    scheme, rows = FORMATS["int4"], 20011
    packed = quantize(torch.randn(rows, 1024), scheme)  # fp16 scales and biases
    head = SimpleNamespace(scheme=scheme, in_cols=1024,
                           **{k: v.to(KDEV) for k, v in packed.items()})
    greedy_cfg = triton_qgemv.config_for(4, rows, 1024, triton_qgemv.TUNED_ARGMAX)
    assert greedy_cfg != triton_qgemv.config_for(4, rows, 1024)
    h = torch.randn(2, 1024).bfloat16()
    vals, _ = triton_qgemv.qgemv_argmax_cuda(h[:1].to(KDEV), {k: v.to(KDEV) for k, v in
                                                              packed.items()}, scheme)
    assert vals.shape[1] == -(-rows // greedy_cfg[0])
    tokens = triton_head.greedy_packed_cuda(h.to(KDEV), head)
    weight = dequantize(packed, scheme, torch.float32)
    assert_argmax_tokens(tokens, F.linear(h.float(), weight), 1e-3)
