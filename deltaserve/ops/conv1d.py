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
    if window is None:
        window = x.new_zeros(bsz, channels, width - 1)
    if seq_len >= width - 1 and _triton_prefill(x):
        from deltaserve.ops.triton_conv1d import causal_conv1d_cuda

        return causal_conv1d_cuda(x, weight, window), _last_inputs(x, width, window.dtype)
    # time-major [B,W-1+T,C]: each tap is a contiguous shifted slice, broadcast over channels
    full = torch.cat([window.transpose(1, 2).to(x.dtype), x], dim=1)
    taps = weight.t().to(x.dtype)  # [W,C]
    if seq_len == 1:  # decode: one dot product per channel
        out = (full * taps).sum(1, keepdim=True)
    else:  # W shifted multiply-adds: oneDNN's depthwise conv1d measured ~25x slower here
        out = full[:, :seq_len] * taps[0]
        for tap in range(1, width):
            out.addcmul_(full[:, tap : tap + seq_len], taps[tap])
    new_window = full[:, -(width - 1) :].transpose(1, 2).contiguous()
    return F.silu(out), new_window


def qkv_conv_usable(x: torch.Tensor, width: int, key_dim: int, head_dim: int) -> bool:
    """causal_conv1d_qkv runs for x: the Triton prefill conv with whole heads per tile, at least
    W-1 tokens (the new window is the chunk's own last inputs)."""
    from deltaserve.env import env
    from deltaserve.ops import triton_conv1d

    return (env().conv_qkv and x.shape[1] >= width - 1 and _triton_prefill(x)
            and triton_conv1d.qkv_usable(key_dim, head_dim))


def causal_conv1d_qkv(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor,
                      key_dim: int, head_dim: int):
    """causal_conv1d for fla's stages (qkv_conv_usable(x)): (l2norm(q), l2norm(k), v, each
    contiguous [B,T,*], new window [B,C,W-1]); spec: causal_conv1d_qkv_ref."""
    from deltaserve.ops.triton_conv1d import causal_conv1d_qkv_cuda

    width = weight.shape[-1]
    if x.shape[1] < width - 1:
        raise ValueError(f"the qkv conv needs at least {width - 1} tokens, got {x.shape[1]}")
    return (*causal_conv1d_qkv_cuda(x, weight, window, key_dim, head_dim),
            _last_inputs(x, width, window.dtype))


def _last_inputs(x: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The new conv window of a chunk x [B,T,C] with T >= W-1: its last W-1 inputs [B,C,W-1]."""
    return x[:, x.shape[1] - (width - 1) :].transpose(1, 2).to(dtype).contiguous()


def _triton_prefill(x: torch.Tensor) -> bool:
    """16-bit CUDA prefill chunks: the one-pass Triton conv (fp32 keeps torch's, as transformers
    computes it, for the fp32 parity margins)."""
    from deltaserve.env import env
    from deltaserve.ops import triton_conv1d

    return (x.is_cuda and x.dtype != torch.float32 and x.shape[1] > 1
            and not env().reference_ops and triton_conv1d.available())


def causal_conv1d_ref(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None
) -> torch.Tensor:
    """Plain loop over taps: the spec for causal_conv1d's output."""
    bsz, seq_len, channels = x.shape
    width = weight.shape[-1]
    prev = x.new_zeros(bsz, width - 1, channels) if window is None else window.transpose(1, 2)
    full = torch.cat([prev.to(x.dtype), x], dim=1).float()  # [B,W-1+T,C]
    out = torch.zeros(bsz, seq_len, channels, device=x.device)
    for tap in range(width):
        out += full[:, tap : tap + seq_len] * weight[:, tap].float()
    return F.silu(out)


def causal_conv1d_qkv_ref(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None,
                          key_dim: int, head_dim: int, eps: float = 1e-6
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec for triton_conv1d.causal_conv1d_qkv_cuda: the conv rounded to x's dtype, split
    into q, k (key_dim each) and v, q and k L2-normalised per head (x / sqrt(sum x^2 + eps),
    fp32) and rounded again."""
    out = causal_conv1d_ref(x, weight, window).to(x.dtype)
    q, k, v = out.split([key_dim, key_dim, out.shape[-1] - 2 * key_dim], dim=-1)

    def l2(t: torch.Tensor) -> torch.Tensor:
        heads = t.float().unflatten(-1, (-1, head_dim))
        return (heads / torch.sqrt((heads * heads).sum(-1, keepdim=True) + eps)).flatten(-2)

    return l2(q).to(x.dtype), l2(k).to(x.dtype), v.contiguous()
