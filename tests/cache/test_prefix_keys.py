"""Prefix-cache keys: the hash chain over int64 token bytes, and the memo that reuses them."""

from __future__ import annotations

import hashlib
import random

import torch

from deltaserve.cache.prefix import MEMO_ENTRIES, PrefixCache, chain_keys


def _reference_chain(seed: bytes, ids: list[int], granularity: int, max_len: int) -> list[bytes]:
    """One block at a time from a tensor's bytes (how the keys were first defined)."""
    keys, key = [], seed
    for end in range(granularity, min(max_len, len(ids)) + 1, granularity):
        block = torch.tensor(ids[end - granularity : end], dtype=torch.int64).numpy().tobytes()
        key = hashlib.blake2b(key + block, digest_size=16).digest()
        keys.append(key)
    return keys


class _KV:
    block_len = 16


def test_keys_match_the_reference_chain_through_the_memo() -> None:
    """Prompts that share prefixes, interleaved as concurrent prefills ask for them (more
    prompts than memo entries), negative ids (image content keys) included."""
    rng = random.Random(0)
    cache = PrefixCache(_KV(), 64, 1 << 20, "fingerprint")
    base = [rng.randrange(-5, 250_000) for _ in range(700)]
    prompts = [base[: 64 * i] + [rng.randrange(250_000) for _ in range(300)]
               for i in range(MEMO_ENTRIES + 3)]
    for _ in range(2):
        for ids in prompts:
            for max_len in (0, 63, 64, 130, len(ids) - 1, len(ids) + 50):
                want = _reference_chain(cache.seed, ids, 64, max_len)
                assert cache.keys(ids, max_len) == want
                assert chain_keys(cache.seed, ids, 64, max_len) == want
    assert len(cache._memo) == MEMO_ENTRIES


def test_a_changed_token_changes_every_later_key() -> None:
    cache = PrefixCache(_KV(), 64, 1 << 20, "fingerprint")
    ids = list(range(1000, 1256))
    before = cache.keys(ids, 256)
    ids2 = list(ids)
    ids2[100] += 1  # block 1 of 4
    after = cache.keys(ids2, 256)
    assert after[0] == before[0] and all(a != b for a, b in zip(after[1:], before[1:], strict=True))
