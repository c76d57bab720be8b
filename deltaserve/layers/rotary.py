"""Partial rotary embedding (NeoX rotate-half on the first rotary_dim dims of each head)."""

from __future__ import annotations

import torch


class Rotary:
    """cos/sin tables for positions; text positions use equal T/H/W mRoPE axes, i.e. plain 1-D RoPE."""

    def __init__(self, rotary_dim: int, theta: float, device: torch.device) -> None:
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
        self.inv_freq = (1.0 / (theta**exponents)).to(device)  # [rotary_dim/2]
        self.rotary_dim = rotary_dim

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rotary_dim] (halves repeated, as rotate-half expects)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B,H,T,D]; rotates dims [0, rotary_dim) and leaves the rest untouched."""
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)
