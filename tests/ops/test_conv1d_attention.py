"""Causal conv with a carried window, and causal GQA attention over a cache, against references."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.attention import causal_attention, causal_attention_ref
from deltaserve.ops.conv1d import causal_conv1d, causal_conv1d_ref


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("seq_len", [1, 3, 17])
def test_conv_matches_reference_with_window(seq_len: int) -> None:
    gen = torch.Generator().manual_seed(seq_len)
    x = torch.randn(2, seq_len, 12, generator=gen)
    w = torch.randn(12, 4, generator=gen)
    window = torch.randn(2, 12, 3, generator=gen)
    out, new_window = causal_conv1d(x, w, window)
    assert rel(out, causal_conv1d_ref(x, w, window)) <= 1e-6
    full = torch.cat([window, x.transpose(1, 2)], -1)
    assert torch.equal(new_window, full[..., -3:])


def test_conv_in_pieces_equals_whole() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 30, 8, generator=gen)
    w = torch.randn(8, 4, generator=gen)
    whole, _ = causal_conv1d(x, w, None)
    window, pieces = None, []
    for start, end in [(0, 5), (5, 6), (6, 20), (20, 21), (21, 30)]:
        out, window = causal_conv1d(x[:, start:end], w, window)
        pieces.append(out)
    assert rel(torch.cat(pieces, 1), whole) <= 1e-6


@pytest.mark.parametrize(
    "seq_len,cache_len", [(9, 9), (1, 9), (4, 13)], ids=["prefill", "decode", "continued"]
)
def test_attention_matches_reference(seq_len: int, cache_len: int) -> None:
    gen = torch.Generator().manual_seed(cache_len)
    q = torch.randn(2, 8, seq_len, 32, generator=gen)
    k = torch.randn(2, 2, cache_len, 32, generator=gen)
    v = torch.randn(2, 2, cache_len, 32, generator=gen)
    assert rel(causal_attention(q, k, v, 32**-0.5), causal_attention_ref(q, k, v, 32**-0.5)) <= 1e-5
