"""The cache manager: owns the state pool, the paged KV pool and the prefix cache, and gives each
request a slot and the KV blocks it needs (the engine scheduler's CacheManager protocol).

KV blocks held only by prefix snapshots are reclaimable: when a running request needs blocks and
the pool is short, least recently used snapshots are evicted first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaserve.cache.batch import SNAP_GRID
from deltaserve.cache.options import PREFIX_SNAPSHOTS
from deltaserve.cache.pools import KVPool, PoolSizes, StatePool
from deltaserve.cache.prefix import PrefixCache
from deltaserve.cache.scratch import Scratch

# the finest snapshot grid: fla's GDN scan chunk, so a snapshot falls on a chunk boundary
PREFIX_GRANULARITY = SNAP_GRID
# tokens per KV block: the largest block that still ends at every grid position, so a prefix hit
# shares whole blocks (none copied) with the fewest block-table entries per sequence
KV_BLOCK_LEN = PREFIX_GRANULARITY


@dataclass(frozen=True, slots=True)
class CacheConfig:
    num_slots: int = 8
    num_blocks: int = 512
    block_len: int = KV_BLOCK_LEN
    # snapshot grid; a multiple of block_len and of the GDN scan chunk
    prefix_granularity: int = PREFIX_GRANULARITY
    prefix_budget_bytes: int = 1 << 30  # 0 disables the prefix cache
    kv_dtype: torch.dtype | None = None  # None: the activation dtype
    # which grid positions a prompt snapshots: "sparse" (its end and where it branches from an
    # earlier prompt) or "grid" (every prefix_granularity tokens): cache/prefix.py
    prefix_snapshots: str = "sparse"

    def __post_init__(self) -> None:
        if self.prefix_granularity % SNAP_GRID or self.prefix_granularity % self.block_len:
            raise ValueError(
                f"prefix_granularity must be a multiple of {SNAP_GRID} (the GDN scan chunk) and of "
                f"block_len={self.block_len}, got {self.prefix_granularity}"
            )
        if self.prefix_snapshots not in PREFIX_SNAPSHOTS:
            raise ValueError(f"prefix_snapshots must be one of {', '.join(PREFIX_SNAPSHOTS)}, "
                             f"got {self.prefix_snapshots!r}")


@dataclass(slots=True)
class _Alloc:
    slot: int
    blocks: list[int] = field(default_factory=list)
    snap_plan: tuple[int, ...] | None = None  # positions to snapshot ("sparse"); None: every one


class CacheManager:
    def __init__(self, model, config: CacheConfig, fingerprint: str) -> None:
        self.config = config
        # one spare slot and block beyond the configured ones: padding rows of a CUDA-graph decode
        # step read and write them, never a sequence's
        sizes = PoolSizes(config.num_slots + 1, config.num_blocks + 1, config.block_len)
        vk = getattr(model, "vulkan", None)
        if vk is not None:  # --device vulkan: the same bookkeeping, storage on that device
            from deltaserve.vulkan.pools import VulkanKVPool, VulkanStatePool

            self.states = VulkanStatePool(model.cfg, config.num_slots + 1, vk.dev)
            self.kv = VulkanKVPool(model.cfg, sizes, vk.dev)
        else:
            self.states = StatePool(model.cfg, config.num_slots + 1, model.act_dtype,
                                    model.device)
            self.kv = KVPool(model.cfg, sizes, config.kv_dtype or model.act_dtype, model.device)
        self.spare_slot, self.spare_block = self.states.allocate(), self.kv.allocate(1)[0]
        self.prefix = (PrefixCache(self.kv, config.prefix_granularity, config.prefix_budget_bytes,
                                   fingerprint) if config.prefix_budget_bytes > 0 else None)
        self._allocs: dict[str, _Alloc] = {}
        self.scratch = Scratch()  # the engine's steps' temporaries (StepBatch.scratch)

    # -- the scheduler's protocol -------------------------------------------------------------
    def capacity_tokens(self) -> int:
        return self.config.num_blocks * self.config.block_len

    def num_free_slots(self) -> int:
        return self.states.num_free

    def admit(self, request_id: str, token_ids: list[int], reuse: bool = True) -> int | None:
        """A slot for the request (None: none free), its state restored from the longest cached
        prefix of token_ids unless reuse is off; returns the positions restored."""
        if request_id in self._allocs:
            raise RuntimeError(f"request {request_id} already holds a slot")
        slot = self.states.allocate()
        if slot is None:
            return None
        alloc = _Alloc(slot)
        snap = self.prefix.lookup(token_ids, len(token_ids) - 1) if self.prefix and reuse \
            else None
        if snap is not None:  # the slot's state and the first blocks come from the snapshot
            self.states.restore(slot, snap.states)
            self.kv.incref(snap.blocks)
            alloc.blocks = list(snap.blocks)
        if self.prefix is not None and self.config.prefix_snapshots == "sparse":
            alloc.snap_plan = self.prefix.plan(token_ids)
        self._allocs[request_id] = alloc
        return 0 if snap is None else snap.length

    def slot_of(self, request_id: str) -> int:
        return self._allocs[request_id].slot

    def reserve(self, request_id: str, num_positions: int) -> bool:
        alloc = self._allocs[request_id]
        need = -(-num_positions // self.config.block_len) - len(alloc.blocks)
        if need <= 0:
            return True
        while self.kv.num_free < need and self.prefix is not None and self.prefix.evict_one():
            pass
        blocks = self.kv.allocate(need)
        if blocks is None:
            return False
        alloc.blocks.extend(blocks)
        return True

    def truncate(self, request_id: str, num_positions: int) -> None:
        """Forget positions >= num_positions (rejected drafts, spec/verify.py): blocks past them
        go back to the pool, and their rows in the last kept block are zeroed as allocate() zeroes
        a fresh block, so the pool holds what a run that never computed them holds."""
        alloc, block_len = self._allocs[request_id], self.config.block_len
        keep = -(-num_positions // block_len)
        self.kv.decref(alloc.blocks[keep:])
        del alloc.blocks[keep:]
        if num_positions % block_len:
            block = alloc.blocks[keep - 1]
            for t in (*self.kv.k, *self.kv.v):
                if t is not None:
                    t[block, :, num_positions % block_len:] = 0

    def release(self, request_id: str) -> None:
        alloc = self._allocs.pop(request_id)
        self.kv.decref(alloc.blocks)
        self.states.free(alloc.slot)

    # -- for the model runner -----------------------------------------------------------------
    def block_table(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._allocs[request_id].blocks)

    def snapshot_positions(self, request_id: str, token_ids: list[int], start: int,
                           end: int) -> tuple[int, ...]:
        """The positions in (start, end] where the request's prefill should keep a snapshot."""
        if self.prefix is None:
            return ()
        plan = self._allocs[request_id].snap_plan
        if plan is None:
            return self.prefix.wanted(token_ids, start, end)
        return self.prefix.uncached(token_ids, tuple(p for p in plan if start < p <= end))

    def store_snapshots(self, request_id: str, token_ids: list[int], snaps: dict) -> None:
        """snaps[position][layer] = (conv window, state) as the GDN layers captured them."""
        if self.prefix is None:
            return
        num_layers = len(self.states.conv)
        for pos, layers in sorted(snaps.items()):
            states = [layers.get(i) for i in range(num_layers)]
            if all((s is None) == (self.states.conv[i] is None) for i, s in enumerate(states)):
                self.prefix.insert(token_ids, pos, states, self._allocs[request_id].blocks)

    def holds(self, request_id: str) -> bool:
        return request_id in self._allocs

    def usage(self) -> dict[str, int]:
        """Memory accounting: what the pools hold, in slots, blocks and bytes."""
        held_by_requests = {b for a in self._allocs.values() for b in a.blocks}
        return {
            "slots_total": self.config.num_slots,
            "slots_used": self.config.num_slots - self.states.num_free,  # the spare is not counted
            "blocks_total": self.config.num_blocks,
            "blocks_free": self.kv.num_free,
            "blocks_held_by_requests": len(held_by_requests),
            "state_bytes_per_slot": self.states.bytes_per_slot(),
            "kv_bytes_per_block": self.kv.bytes_per_block(),
            "prefix_bytes": self.prefix.nbytes if self.prefix else 0,
            "prefix_entries": len(self.prefix.entries) if self.prefix else 0,
        }
