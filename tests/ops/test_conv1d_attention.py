"""Causal conv with a carried window, and causal GQA attention over a cache, against references."""

from __future__ import annotations

import pytest
import torch

from deltaserve.env import env
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seq_len,cache_len", [(300, 1000), (64, 65), (128, 128)])
def test_cuda_attention_behind_cached_keys_matches_reference(seq_len: int, cache_len: int,
                                                             monkeypatch) -> None:
    """A bf16 chunk behind cached keys: under SPLIT_MIN_QUERIES rows flash attention's
    bottom-right causal variant (no [T,S] mask), and the split (two cuDNN calls merged by
    log-sum-exp, which longer chunks take) called directly: each the fp32 reference within bf16
    rounding; head dim 256, GQA 8:2 as Qwen3.5."""
    gen = torch.Generator(device="cuda").manual_seed(seq_len)
    q = torch.randn(1, 8, seq_len, 256, generator=gen, device="cuda").bfloat16()
    k = torch.randn(1, 2, cache_len, 256, generator=gen, device="cuda").bfloat16()
    v = torch.randn(1, 2, cache_len, 256, generator=gen, device="cuda").bfloat16()
    from deltaserve.ops import attention

    ref = causal_attention_ref(q, k, v, 256**-0.5)
    out = causal_attention(q, k, v, 256**-0.5)
    assert out.shape == q.shape and rel(out, ref) <= 1e-2
    if seq_len < cache_len:  # the cuDNN split merged by log-sum-exp, itself, and its self-check
        monkeypatch.setenv("DELTASERVE_SPLIT_ATTENTION", "1")
        env.cache_clear()
        monkeypatch.setattr(attention, "_split_checked", None)
        try:
            split = attention._split_attention(q, k, v, 256**-0.5)
        finally:
            monkeypatch.delenv("DELTASERVE_SPLIT_ATTENTION")
            env.cache_clear()
        print(f"split vs reference rel {rel(split, ref):.2e}, self-check {attention._split_checked}")
        assert attention._split_checked and rel(split, ref) <= 1e-2


def test_graph_chunk_window_is_the_last_real_inputs() -> None:
    """The padded chunk's new conv window: rows real_len .. real_len+W-2 of [old window | chunk],
    gathered without the concatenation, for chunks shorter and longer than the window."""
    from deltaserve.cache.batch import window_at

    gen = torch.Generator().manual_seed(0)
    window, rows = torch.randn(6, 3, generator=gen), torch.randn(10, 6, generator=gen)
    full = torch.cat([window.t(), rows])  # [W-1+T, C]
    for real_len in (1, 2, 3, 7, 10):
        at = torch.arange(3) + real_len
        assert torch.equal(window_at(window, rows, at), full[at].t())
