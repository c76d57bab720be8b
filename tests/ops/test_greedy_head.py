"""The tiled greedy head against argmax of the full logits: dense and quantized heads, ties."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deltaserve.layers.linear import linear
from deltaserve.ops.greedy_head import greedy_tokens
from deltaserve.quant.linear import quant_linear
from deltaserve.quant.schemes import FORMATS, quantize


def dense(dtype):
    torch.manual_seed(0)
    return SimpleNamespace(weight=torch.randn(5000, 96).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_tiles_give_the_full_argmax(dtype, rows) -> None:
    head = dense(dtype)
    h = torch.randn(rows, 96)
    full = linear(h, head.weight).float()
    assert torch.equal(greedy_tokens(h, head, tile_rows=1024), full.argmax(-1))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_head_tiles_give_the_full_argmax(fmt) -> None:
    torch.manual_seed(1)
    scheme = FORMATS[fmt]
    packed = quantize(torch.randn(5000, 128), scheme)
    head = SimpleNamespace(scheme=scheme, in_cols=128,
                           **{k: (v.float() if v.is_floating_point() else v) for k, v in packed.items()})
    h = torch.randn(4, 128)
    full = quant_linear(h, head).float()
    assert torch.equal(greedy_tokens(h, head, tile_rows=1024), full.argmax(-1))


def test_a_tie_across_tiles_keeps_the_first_index() -> None:
    head = dense(torch.float32)
    head.weight[4500] = head.weight[200]  # rows in different 1024-row tiles
    h = head.weight[200:201].clone() * 10  # row 200 (and its copy) score highest
    assert greedy_tokens(h, head, tile_rows=1024).tolist() == [200]
    assert linear(h, head.weight).argmax(-1).tolist() == [200]
