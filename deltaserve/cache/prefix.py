"""Exact prefix-state cache: snapshots of every GDN layer's state (conv window + recurrent matrix)
and of the KV blocks before position P, for P on a fixed grid (every `granularity` tokens) of the
prompts that ran. A request resumes from its longest snapshotted prefix.

Which grid positions a prompt snapshots (`plan`): a snapshot of the 0.8B model is ~19 MB, so one
every 64 tokens of an 8k prompt (2.4 GB) would not fit the default 1 GiB budget, and its own tail
would evict its head. By default ("sparse") a prompt keeps two: its last grid position before its
final token (the same prompt again, or the next turn of a conversation, resumes there) and the
deepest grid position it shares with an earlier prompt (a shared system prompt's end, from its
second use on; the keys of recent prompts are remembered for this, SEEN_MAX_KEYS of them). "grid"
keeps every grid position.

Keys form a hash chain over the token ids, block by block, seeded with the model fingerprint: a key
names a whole prefix, never a suffix that happens to match. LRU eviction under a byte budget
(snapshot state bytes; the KV blocks they hold live in the KV pool and are given back on demand).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from deltaserve.cache.pools import KVPool

MEMO_ENTRIES = 8
SEEN_MAX_KEYS = 1 << 17  # keys of earlier prompts' grid positions (8M tokens at 64; ~17 MiB)
PLANS_KEPT = 4096  # prompts whose plan is remembered (by their last key)
LayerState = tuple[torch.Tensor, torch.Tensor] | None  # (conv window [C,W-1], state [HV,K,V])


@dataclass(slots=True)
class Snapshot:
    key: bytes
    length: int  # positions covered: a multiple of the granularity
    states: list[LayerState]  # per layer; None for attention layers
    blocks: list[int]  # KV blocks of positions [0, length); one reference held here
    nbytes: int


def chain_keys(seed: bytes, token_ids: list[int], granularity: int, max_len: int) -> list[bytes]:
    """keys[i] names the prefix token_ids[: (i+1) * granularity], for every full step <= max_len.
    A block's bytes are its ids as little-endian int64 (one conversion of the whole prefix: a
    tensor per block cost ~40 us each, 2.5 ms per 4k-token request on the CI CPU)."""
    num_steps = min(max_len, len(token_ids)) // granularity
    data = memoryview(_int64_bytes(token_ids[: num_steps * granularity]))
    step_bytes = 8 * granularity
    keys, key = [], seed
    for i in range(num_steps):
        key = hashlib.blake2b(key + data[i * step_bytes : (i + 1) * step_bytes],
                              digest_size=16).digest()
        keys.append(key)
    return keys


def _int64_bytes(ids: list[int]) -> bytes:
    out = array("q", ids)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


class PrefixCache:
    def __init__(self, kv: KVPool, granularity: int, budget_bytes: int, fingerprint: str) -> None:
        if granularity % kv.block_len:
            raise ValueError(f"granularity {granularity} must be a multiple of the KV block length "
                             f"{kv.block_len}")
        self.kv, self.granularity, self.budget_bytes = kv, granularity, budget_bytes
        self.fingerprint = fingerprint
        self.seed = hashlib.blake2b(fingerprint.encode(), digest_size=16).digest()
        self.entries: OrderedDict[bytes, Snapshot] = OrderedDict()  # oldest use first
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0
        self._memo: list[tuple[list[int], list[bytes]]] = []  # most recent first
        self.seen: OrderedDict[bytes, None] = OrderedDict()  # earlier prompts' keys, oldest first
        self._plans: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()

    def keys(self, token_ids: list[int], max_len: int) -> list[bytes]:
        """Chain keys. Admission asks for a request's keys several times (lookup, plan or wanted,
        insert) and prefill chunks ask again, so the last MEMO_ENTRIES prompts' keys are kept
        (several prompts prefill side by side) and reused for any prefix of them."""
        steps = min(max_len, len(token_ids)) // self.granularity
        need = steps * self.granularity
        for i, (ids, keys) in enumerate(self._memo):
            # a list compare: ~15 us for 4k ids, against ~1 ms to hash them
            if len(ids) >= need and ids[:need] == token_ids[:need]:
                if i:
                    self._memo.insert(0, self._memo.pop(i))
                return keys[:steps]
        keys = chain_keys(self.seed, token_ids, self.granularity, len(token_ids))
        self._memo.insert(0, (list(token_ids), keys))
        del self._memo[MEMO_ENTRIES:]
        return keys[:steps]

    def lookup(self, token_ids: list[int], max_len: int) -> Snapshot | None:
        """The longest cached prefix of token_ids no longer than max_len (marked recently used)."""
        for key in reversed(self.keys(token_ids, max_len)):
            snap = self.entries.get(key)
            if snap is not None:
                self.entries.move_to_end(key)
                self.hits += 1
                return snap
        self.misses += 1
        return None

    def wanted(self, token_ids: list[int], start: int, end: int) -> tuple[int, ...]:
        """Grid positions in (start, end] not cached yet (where a prefill should snapshot)."""
        keys = self.keys(token_ids, end)
        first = start // self.granularity  # keys[i] is position (i+1)*granularity
        return tuple((i + 1) * self.granularity for i in range(first, len(keys))
                     if keys[i] not in self.entries)

    def plan(self, token_ids: list[int]) -> tuple[int, ...]:
        """The grid positions of a prompt worth a snapshot ("sparse", module docstring): its last
        one before its final token (so that the same prompt again can resume there: a lookup
        leaves a token to compute) and the deepest one an earlier prompt shared. Then remembers
        its keys. A prompt planned before (a request admitted again after a preemption, or the
        same prompt sent again) gets its first plan: its own keys are not an earlier prompt's."""
        keys = self.keys(token_ids, len(token_ids) - 1)
        if not keys:
            return ()
        if keys[-1] in self._plans:
            self._plans.move_to_end(keys[-1])
            self._remember(keys)
            return self._plans[keys[-1]]
        out = {len(keys) * self.granularity}
        shared = next((i for i in range(len(keys) - 1, -1, -1) if keys[i] in self.seen), None)
        if shared is not None:
            out.add((shared + 1) * self.granularity)
        self._remember(keys)
        self._plans[keys[-1]] = plan = tuple(sorted(out))
        while len(self._plans) > PLANS_KEPT:
            self._plans.popitem(last=False)
        return plan

    def _remember(self, keys: list[bytes]) -> None:
        for key in keys:
            self.seen[key] = None
            self.seen.move_to_end(key)
        while len(self.seen) > SEEN_MAX_KEYS:
            self.seen.popitem(last=False)

    def uncached(self, token_ids: list[int], positions: tuple[int, ...]) -> tuple[int, ...]:
        """The grid positions among `positions` with no snapshot yet."""
        if not positions:
            return ()
        keys = self.keys(token_ids, max(positions))
        return tuple(p for p in positions if keys[p // self.granularity - 1] not in self.entries)

    def insert(self, token_ids: list[int], length: int, states: list[LayerState],
               blocks: list[int]) -> None:
        """Keep a snapshot at `length` (takes a reference on blocks[: length / block_len])."""
        if length % self.granularity or length > len(token_ids):
            raise ValueError(f"snapshot length {length} is off the {self.granularity}-token grid")
        key = self.keys(token_ids, length)[-1]
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        held = list(blocks[: length // self.kv.block_len])
        nbytes = sum(c.numel() * c.element_size() + r.numel() * r.element_size()
                     for s in states if s is not None for c, r in [s])
        if nbytes > self.budget_bytes:
            return
        self.kv.incref(held)
        self.entries[key] = Snapshot(key, length, states, held, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.budget_bytes:
            self.evict_one()

    def evict_one(self) -> bool:
        """Drop the least recently used snapshot; False when empty."""
        if not self.entries:
            return False
        _, snap = self.entries.popitem(last=False)
        self.kv.decref(snap.blocks)
        self.nbytes -= snap.nbytes
        self.evictions += 1
        return True

    def clear(self) -> None:
        while self.evict_one():
            pass

    def stats(self) -> dict[str, int]:
        return {"entries": len(self.entries), "bytes": self.nbytes, "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions}
