"""The load-time memory plan and the fits-check (no GPU needed: free memory is passed in)."""

from __future__ import annotations

import pytest

from deltaserve.cache.manager import CacheConfig, CacheManager
from deltaserve.cache.memory import fit_blocks, plan, unit_bytes
from deltaserve.errors import CapacityError

MiB = 1 << 20


def test_unit_bytes_match_the_pools_built(tiny_llm) -> None:
    per_slot, per_block = unit_bytes(tiny_llm.model, 16)
    config = CacheConfig(num_slots=2, num_blocks=3, block_len=16, prefix_budget_bytes=0)
    manager = CacheManager(tiny_llm.model, config, "x")
    assert per_slot == manager.states.bytes_per_slot() > 0
    assert per_block == manager.kv.bytes_per_block() > 0


def test_fit_blocks_takes_what_fits_and_refuses_with_the_largest_context() -> None:
    # slots 4 x 10 MiB, blocks of 1 MiB (64 tokens), scratch 50 MiB
    args = dict(per_slot=10 * MiB, per_block=MiB, block_len=64, num_slots=4, scratch=50 * MiB)
    assert fit_blocks(want_blocks=100, min_blocks=10, available=1000 * MiB, **args) == 100
    assert fit_blocks(want_blocks=100, min_blocks=10, available=120 * MiB, **args) == 30
    with pytest.raises(CapacityError, match=r"largest context that fits is 1,920 tokens"):
        fit_blocks(want_blocks=100, min_blocks=40, available=120 * MiB, **args)
    with pytest.raises(CapacityError, match="not even one sequence's state fits"):
        fit_blocks(want_blocks=100, min_blocks=40, available=60 * MiB, **args)


def test_plan_reports_and_sizes_the_engine(tiny_llm) -> None:
    blocks, report = plan(tiny_llm.model, 4096, 8, 1 << 30, 64, 2048)
    assert blocks == 8 * 64  # every slot can reach 4,096 tokens inside the 1 GiB budget
    assert report.kv_capacity_tokens == blocks * 64 and report.num_slots == 8
    assert report.weights_bytes > 0 and report.state_bytes_per_seq > 0
    assert report.headroom_bytes == report.available_bytes - report.pool_bytes - report.scratch_bytes
    assert "KV 32,768 tokens" in report.summary()
    tight, _ = plan(tiny_llm.model, 4096, 8, 10 * report.kv_bytes_per_token * 64, 64, 2048)
    assert tight == 64  # the budget binds, but one max-length sequence always fits
    assert tiny_llm.engine.memory_report is not None
