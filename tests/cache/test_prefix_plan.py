"""Where prompts keep prefix snapshots by default ("sparse", cache/prefix.py): at their last grid
position and where they branch from an earlier prompt; the remembered keys stay bounded."""

from __future__ import annotations

import random

from deltaserve.cache import prefix as prefix_mod
from deltaserve.cache.prefix import PrefixCache


class _KV:
    block_len = 16

    def incref(self, blocks) -> None:
        pass

    def decref(self, blocks) -> None:
        pass


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(250_000) for _ in range(n)]


def test_a_prompt_plans_its_end_and_its_branch_from_earlier_prompts() -> None:
    rng = random.Random(0)
    cache = PrefixCache(_KV(), 64, 1 << 20, "fp")
    system = _ids(rng, 150)
    assert cache.plan(_ids(rng, 63)) == ()  # under one grid step: nothing
    assert cache.plan(system + _ids(rng, 40)) == (128,)  # first use: only its end (190 -> 128)
    # second use of the system prompt: 128 is also where it branches (shared 150 -> grid 128)
    assert cache.plan(system + _ids(rng, 200)) == (128, 320)
    # a later turn of that conversation shares everything up to its end: one snapshot there
    turn = system + _ids(rng, 300)
    assert cache.plan(turn) == (128, 448)
    assert cache.plan(turn + _ids(rng, 100)) == (448, 512)
    # the same prompt again (or admitted again after a preemption): its first plan, not its own
    # keys taken for an earlier prompt's
    assert cache.plan(turn) == (128, 448)
    # a length on the grid: the last position before the final token, where a repeat resumes
    grid = _ids(rng, 256)
    assert cache.plan(grid) == (192,)
    assert cache.plan(grid) == (192,)


def test_uncached_filters_positions_with_a_snapshot() -> None:
    rng = random.Random(1)
    cache = PrefixCache(_KV(), 64, 1 << 20, "fp")
    ids = _ids(rng, 300)
    cache.insert(ids, 128, [], [])
    assert cache.uncached(ids, (64, 128, 256)) == (64, 256)
    assert cache.uncached(ids, ()) == ()


def test_remembered_keys_are_bounded(monkeypatch) -> None:
    """Past SEEN_MAX_KEYS the oldest prompts are forgotten: their branch is no longer found."""
    monkeypatch.setattr(prefix_mod, "SEEN_MAX_KEYS", 8)
    rng = random.Random(2)
    cache = PrefixCache(_KV(), 64, 1 << 20, "fp")
    first = _ids(rng, 257)  # 4 keys
    cache.plan(first)
    assert cache.plan(first[:200] + _ids(rng, 65)) == (192, 256)  # still remembered
    for _ in range(3):
        cache.plan(_ids(rng, 257))
    assert len(cache.seen) == 8
    assert cache.plan(first[:200] + _ids(rng, 66)) == (256,)
