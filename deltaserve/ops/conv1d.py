"""Causal depthwise conv1d with a carried window (the GDN short convolution), followed by SiLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B,T,C]; weight [C,W]; window [B,C,W-1] = the last W-1 pre-conv inputs (None = zeros).

    Returns (silu(conv(x)) [B,T,C], new window [B,C,W-1]). Tap W-1 multiplies the current token.
    """
    bsz, seq_len, channels = x.shape
    width = weight.shape[-1]
    xt = x.transpose(1, 2).to(weight.dtype)  # [B,C,T]
    if window is None:
        window = xt.new_zeros(bsz, channels, width - 1)
    full = torch.cat([window.to(weight.dtype), xt], dim=-1)  # [B,C,W-1+T]
    if seq_len == 1:  # decode: one dot product per channel beats a conv launch
        out = (full * weight).sum(-1, keepdim=True)
    else:
        out = F.conv1d(full, weight.unsqueeze(1), groups=channels)
    new_window = full[..., -(width - 1) :].contiguous()
    return F.silu(out).transpose(1, 2).to(x.dtype), new_window


def causal_conv1d_ref(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None
) -> torch.Tensor:
    """Plain loop over taps: the spec for causal_conv1d's output."""
    bsz, seq_len, channels = x.shape
    width = weight.shape[-1]
    prev = x.new_zeros(bsz, width - 1, channels) if window is None else window.transpose(1, 2)
    full = torch.cat([prev.to(x.dtype), x], dim=1).float()  # [B,W-1+T,C]
    out = torch.zeros(bsz, seq_len, channels)
    for tap in range(width):
        out += full[:, tap : tap + seq_len] * weight[:, tap].float()
    return F.silu(out)
