"""Device memory for many sequences: a state pool (one slot per sequence: the conv window and the
recurrent matrix of every GDN layer) and a paged KV pool (fixed-size blocks of K/V for every
attention layer, shared by reference count so prefix snapshots and requests can hold the same block).

Shapes (the alphabet of docs/architecture.md): S slots, NB blocks, L block_len, C conv channels,
W conv width, HV value heads, K/V head dims, HKV kv heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.config import FULL, TextConfig


@dataclass(frozen=True, slots=True)
class PoolSizes:
    num_slots: int  # sequences that can hold state at once (running + parked)
    num_blocks: int  # KV blocks of block_len positions, shared by all sequences
    block_len: int = 64

    def __post_init__(self) -> None:
        if min(self.num_slots, self.num_blocks, self.block_len) < 1:
            raise ValueError(f"pool sizes must be positive, got {self}")


class StatePool:
    """conv[layer] [S,C,W-1] in the activation dtype, recurrent[layer] [S,HV,K,V] fp32 (GDN layers;
    None for attention layers). A freed slot is zeroed when it is handed out again."""

    def __init__(self, cfg: TextConfig, num_slots: int, act_dtype: torch.dtype, device) -> None:
        self.num_slots = num_slots
        self.conv: list[torch.Tensor | None] = []
        self.recurrent: list[torch.Tensor | None] = []
        for layer_type in cfg.layer_types:
            if layer_type == FULL:
                self.conv.append(None), self.recurrent.append(None)
                continue
            c_shape = (num_slots, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)
            r_shape = (num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                       cfg.linear_value_head_dim)
            # empty: pages are touched only by slots in use; allocate() zeroes a slot
            self.conv.append(torch.empty(c_shape, dtype=act_dtype, device=device))
            self.recurrent.append(torch.empty(r_shape, dtype=torch.float32, device=device))
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self.reset(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"state slot {slot} freed twice or out of range")
        self._free.append(slot)

    def reset(self, slot: int) -> None:
        """Zero one slot; its neighbours are untouched (tests check). One multi-tensor launch per
        dtype on CUDA (conv windows, recurrent matrices) instead of one per layer and kind (36
        for the 0.8B shape); a pipeline stage without GDN layers has nothing to zero."""
        for group in (self.conv, self.recurrent):
            views = [t[slot] for t in group if t is not None]
            if views:
                torch._foreach_zero_(views)

    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (*self.conv, *self.recurrent) if t is not None)

    def snapshot(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Copies of one slot's state, per layer (None for attention layers)."""
        return [None if c is None else (c[slot].clone(), r[slot].clone())
                for c, r in zip(self.conv, self.recurrent, strict=True)]

    def restore(self, slot: int, snap: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """The slot's state from a snapshot: one multi-tensor copy per kind on CUDA."""
        for kind, group in enumerate((self.conv, self.recurrent)):
            pairs = [(t[slot], s[kind]) for t, s in zip(group, snap, strict=True) if t is not None]
            if pairs:
                torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


class KVPool:
    """k[layer], v[layer] [NB,HKV,L,D] for attention layers (None for GDN layers). Blocks carry a
    reference count: a block returns to the free list when its last holder lets it go."""

    def __init__(self, cfg: TextConfig, sizes: PoolSizes, act_dtype: torch.dtype, device) -> None:
        self.block_len, self.num_blocks, self.device = sizes.block_len, sizes.num_blocks, device
        shape = (sizes.num_blocks, cfg.num_key_value_heads, sizes.block_len, cfg.head_dim)
        # empty (untouched until used); allocate() zeroes its blocks so the rows a sequence has
        # not written yet hold zeros, never stale NaNs that a masked-out key would still multiply
        self.k = [torch.empty(shape, dtype=act_dtype, device=device) if t == FULL else None
                  for t in cfg.layer_types]
        self.v = [None if k is None else torch.empty_like(k) for k in self.k]
        self.refs = [0] * sizes.num_blocks
        self._free = list(range(sizes.num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks (each with one reference), or None and nothing taken."""
        if count > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(count)]
        for b in blocks:
            self.refs[b] = 1
        if blocks:
            self._zero(blocks)
        return blocks

    def _zero(self, blocks: list[int]) -> None:
        """Fresh blocks hold zeros, never an earlier sequence's K/V."""
        index = torch.tensor(blocks, device=self.device)
        for t in (*self.k, *self.v):
            if t is not None:
                t.index_fill_(0, index, 0)


    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.refs[b] <= 0:
                raise RuntimeError(f"KV block {b} is not allocated")
            self.refs[b] += 1

    def decref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.refs[b] <= 0:
                raise RuntimeError(f"KV block {b} released more often than taken")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free.append(b)

    def bytes_per_block(self) -> int:
        return sum(2 * k[0].numel() * k.element_size() for k in self.k if k is not None)

    def block_layout(self, layer: int) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """(dtype, [HKV, L, D]) of one block of an attention layer; None for a GDN layer."""
        k = self.k[layer]
        return None if k is None else (k.dtype, tuple(k.shape[1:]))

    def read_blocks(self, layer: int, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Host copies of whole blocks: k, v [len(blocks), HKV, L, D] (snapshot export)."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return tuple(x[layer][index].cpu().contiguous() for x in (self.k, self.v))

    def write_blocks(self, layer: int, blocks: list[int], k: torch.Tensor, v: torch.Tensor
                     ) -> None:
        """Whole blocks from host tensors as read_blocks gives them (snapshot import)."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        self.k[layer][index] = k.to(self.device)
        self.v[layer][index] = v.to(self.device)

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k_new: torch.Tensor,
              v_new: torch.Tensor) -> None:
        """Position t of k_new/v_new [T,HKV,D] goes to block blocks[t], row offsets[t]."""
        self.k[layer][blocks, :, offsets] = k_new.to(self.k[layer].dtype)
        self.v[layer][blocks, :, offsets] = v_new.to(self.v[layer].dtype)

    def read(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """What write() stored for positions (blocks[t], offsets[t]), laid out as gather()'s:
        k, v [1,HKV,T,D]."""
        return tuple(x[layer][blocks, :, offsets].transpose(0, 1)[None] for x in (self.k, self.v))

    def gather(self, layer: int, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first `length` positions as [1,HKV,length,D] (table: its block ids)."""
        k, v = (x[layer][table].transpose(0, 1).flatten(1, 2)[:, :length].unsqueeze(0)
                for x in (self.k, self.v))
        return k, v

    def gather_batch(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tables [B,NBmax] (padded with any valid block id) -> k, v [B,HKV,NBmax*L,D]."""
        bsz, width = tables.shape
        k, v = (x[layer][tables.reshape(-1)].reshape(bsz, width, *x[layer].shape[1:])
                .transpose(1, 2).flatten(2, 3) for x in (self.k, self.v))
        return k, v
