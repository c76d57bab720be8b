"""The engine's state and KV pools with their storage on the Vulkan device: the same slot and
block bookkeeping as cache/pools.py (the cache manager and the prefix cache drive them unchanged);
a slot's reset, snapshot and restore and a block's zeroing move bytes to and from the GPU."""

from __future__ import annotations

import numpy as np
import torch

from deltaserve.cache.pools import KVPool, PoolSizes, StatePool
from deltaserve.config import FULL, TextConfig
from deltaserve.vulkan.device import Tensor, VulkanDevice


def _row_bytes(t: Tensor) -> int:
    return int(np.prod(t.shape[1:])) * 4


class VulkanStatePool(StatePool):
    """conv[layer] [S,C,W-1] and recurrent[layer] [S,HV,K,V], f32 device arrays (None for
    attention layers)."""

    def __init__(self, cfg: TextConfig, num_slots: int, dev: VulkanDevice) -> None:
        self.num_slots, self.dev = num_slots, dev
        self.conv, self.recurrent = [], []
        for layer_type in cfg.layer_types:
            if layer_type == FULL:
                self.conv.append(None), self.recurrent.append(None)
                continue
            self.conv.append(dev.empty((num_slots, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)))
            self.recurrent.append(dev.empty((num_slots, cfg.linear_num_value_heads,
                                             cfg.linear_key_head_dim, cfg.linear_value_head_dim)))
        self._free = list(range(num_slots - 1, -1, -1))

    def _arrays(self):
        return [t for t in (*self.conv, *self.recurrent) if t is not None]

    def reset(self, slot: int) -> None:
        for t in self._arrays():
            self.dev.write(t, np.zeros(_row_bytes(t) // 4, np.float32), slot * _row_bytes(t))

    def bytes_per_slot(self) -> int:
        return sum(_row_bytes(t) for t in self._arrays())

    def snapshot(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Host copies of one slot's state, per layer (the prefix cache keeps them)."""
        def row(t: Tensor) -> torch.Tensor:
            n = _row_bytes(t) // 4
            return torch.from_numpy(self.dev.read_range(t, slot * n, n)).reshape(t.shape[1:])
        return [None if c is None else (row(c), row(r))
                for c, r in zip(self.conv, self.recurrent, strict=True)]

    def restore(self, slot: int, snap) -> None:
        for c, r, s in zip(self.conv, self.recurrent, snap, strict=True):
            if c is not None:
                self.dev.write(c, s[0].float().contiguous().numpy(), slot * _row_bytes(c))
                self.dev.write(r, s[1].float().contiguous().numpy(), slot * _row_bytes(r))


class VulkanKVPool(KVPool):
    """k[layer], v[layer] [NB,HKV,L,D] f32 device arrays for attention layers."""

    def __init__(self, cfg: TextConfig, sizes: PoolSizes, dev: VulkanDevice) -> None:
        self.block_len, self.num_blocks, self.device, self.dev = \
            sizes.block_len, sizes.num_blocks, torch.device("cpu"), dev
        shape = (sizes.num_blocks, cfg.num_key_value_heads, sizes.block_len, cfg.head_dim)
        self.k = [dev.empty(shape) if t == FULL else None for t in cfg.layer_types]
        self.v = [None if k is None else dev.empty(shape) for k in self.k]
        self.refs = [0] * sizes.num_blocks
        self._free = list(range(sizes.num_blocks - 1, -1, -1))

    def _zero(self, blocks: list[int]) -> None:
        for b in blocks:
            for t in (*self.k, *self.v):
                if t is not None:
                    self.dev.write(t, np.zeros(_row_bytes(t) // 4, np.float32), b * _row_bytes(t))

    def bytes_per_block(self) -> int:
        return sum(2 * _row_bytes(k) for k in self.k if k is not None)

    def block_layout(self, layer: int):
        k = self.k[layer]
        return None if k is None else (torch.float32, tuple(k.shape[1:]))

    def read_blocks(self, layer: int, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        def read(t: Tensor) -> torch.Tensor:
            n = _row_bytes(t) // 4
            rows = [self.dev.read_range(t, b * n, n) for b in blocks]
            return torch.from_numpy(np.stack(rows)).reshape(len(blocks), *t.shape[1:])
        return read(self.k[layer]), read(self.v[layer])

    def write_blocks(self, layer: int, blocks: list[int], k: torch.Tensor, v: torch.Tensor
                     ) -> None:
        for t, src in ((self.k[layer], k), (self.v[layer], v)):
            rows = src.float().contiguous().numpy()
            for i, b in enumerate(blocks):
                self.dev.write(t, rows[i], b * _row_bytes(t))
