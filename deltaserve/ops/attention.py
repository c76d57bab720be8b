"""Causal GQA softmax attention over a KV cache (torch SDPA), with a plain reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B,HQ,T,D] are the last T positions of the S cached ones in k, v [B,HKV,S,D].

    Query i sits at position S-T+i and attends to keys 0..S-T+i. Returns [B,HQ,T,D].
    """
    seq_len, cache_len = q.shape[2], k.shape[2]
    if seq_len == 1:
        mask, causal = None, False
    elif seq_len == cache_len:
        mask, causal = None, True
    else:
        rows = torch.arange(cache_len - seq_len, cache_len, device=q.device)[:, None]
        mask, causal = torch.arange(cache_len, device=q.device)[None, :] <= rows, False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )


def causal_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Two GEMMs and a masked softmax in fp32, heads expanded explicitly."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.float().repeat_interleave(groups, dim=1) for x in (k, v))
    seq_len, cache_len = q.shape[2], k.shape[2]
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    rows = torch.arange(cache_len - seq_len, cache_len)[:, None]
    scores = scores.masked_fill(torch.arange(cache_len)[None, :] > rows, float("-inf"))
    return scores.softmax(-1) @ v
