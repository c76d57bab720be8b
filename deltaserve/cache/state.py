"""A growable K/V cache for one attention layer of one sequence: the MTP drafter's (spec/mtp.py).
The target model's K/V live in the paged pool (cache/pools.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
