"""Per-sequence decoding state: GDN conv windows and recurrent matrices, attention KV, position."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.config import FULL, TextConfig


@dataclass(slots=True)
class KVCache:
    """Growable K/V for one attention layer: k, v [B,HKV,capacity,D]; the first `length` are valid."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append [B,HKV,T,D] and return views of all valid entries [B,HKV,S,D]."""
        new_len = self.length + k_new.shape[2]
        if new_len > self.k.shape[2]:  # grow geometrically so appends stay amortised O(1)
            capacity = max(new_len, 2 * self.k.shape[2], 256)
            self.k = _grow(self.k, capacity, self.length)
            self.v = _grow(self.v, capacity, self.length)
        self.k[:, :, self.length : new_len] = k_new
        self.v[:, :, self.length : new_len] = v_new
        self.length = new_len
        return self.k[:, :, :new_len], self.v[:, :, :new_len]


def _grow(x: torch.Tensor, capacity: int, used: int) -> torch.Tensor:
    out = x.new_empty(x.shape[0], x.shape[1], capacity, x.shape[3])
    out[:, :, :used] = x[:, :, :used]
    return out


@dataclass(slots=True)
class SequenceState:
    """Everything a batch of B sequences carries between forward calls (all at the same position)."""

    conv: list[torch.Tensor | None]  # per layer: [B,C,W-1] for GDN layers, None for attention
    recurrent: list[torch.Tensor | None]  # per layer: [B,HV,K,V] fp32 for GDN layers
    kv: list[KVCache | None]  # per layer: KV for attention layers
    position: int = 0  # tokens consumed so far

    @classmethod
    def empty(
        cls, cfg: TextConfig, batch_size: int, act_dtype: torch.dtype, device: torch.device
    ) -> SequenceState:
        conv, recurrent, kv = [], [], []
        for layer_type in cfg.layer_types:
            if layer_type == FULL:
                shape = (batch_size, cfg.num_key_value_heads, 0, cfg.head_dim)
                z = torch.empty(shape, dtype=act_dtype, device=device)
                conv.append(None), recurrent.append(None), kv.append(KVCache(z, z.clone()))
            else:
                c_shape = (batch_size, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)
                r_shape = (
                    batch_size,
                    cfg.linear_num_value_heads,
                    cfg.linear_key_head_dim,
                    cfg.linear_value_head_dim,
                )
                conv.append(torch.zeros(c_shape, dtype=act_dtype, device=device))
                recurrent.append(torch.zeros(r_shape, dtype=torch.float32, device=device))
                kv.append(None)
        return cls(conv=conv, recurrent=recurrent, kv=kv)
