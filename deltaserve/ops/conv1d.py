"""Causal depthwise conv1d with a carried window (the GDN short convolution), followed by SiLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.ops.dispatch import REFERENCE, Case, Op, case

CAUSAL_CONV1D = Op("causal_conv1d", "GDN short convolution with a carried window, then SiLU",
                   ("prefill of T>=W-1",))


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
    return CAUSAL_CONV1D(case(x, (seq_len > 1 and seq_len >= width - 1,)), x, weight, window)


def _triton_why_not(c: Case) -> str | None:
    """16-bit CUDA prefill chunks of at least W-1 tokens (the new window is then the chunk's own
    last inputs): the one-pass Triton conv; fp32 keeps torch's, as transformers computes it (the
    fp32 parity margins)."""
    if c.device != "cuda" or c.dtype == torch.float32:
        return "not 16-bit CUDA activations"
    if not c.shape[0]:
        return "a decode row or fewer tokens than the window"
    from deltaserve.ops import triton_conv1d

    return None if triton_conv1d.available() else "the triton backend is off"


@CAUSAL_CONV1D.register("triton", 30, _triton_why_not)
def _causal_conv1d_triton(x, weight, window):
    from deltaserve.ops.triton_conv1d import causal_conv1d_cuda

    width = weight.shape[-1]
    return causal_conv1d_cuda(x, weight, window), _last_inputs(x, width, window.dtype)


@CAUSAL_CONV1D.register(REFERENCE, 0)
def _causal_conv1d_torch(x, weight, window):
    seq_len, width = x.shape[1], weight.shape[-1]
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


def causal_conv1d_qkv(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor,
                      key_dim: int, head_dim: int):
    """causal_conv1d for fla's stages (ops/gdn_prefill): (l2norm(q), l2norm(k), v, each
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
