"""Scheduler policy against a fake cache manager and a fake runner (pure Python, no model).

The fake runner folds every token it is fed into a per-slot hash (a stand-in for the recurrent
state) and samples from that hash, so any token skipped, repeated or reordered changes a
request's outputs: comparing outputs with a solo run checks the chunking end to end.
"""

from __future__ import annotations

import math
import random
import zlib
from collections import defaultdict

import pytest

from deltaserve.engine.request import Request, Status
from deltaserve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, StepPlan
from deltaserve.errors import CapacityError, RequestError


def fold(h: int, tokens) -> int:
    for t in tokens:
        h = zlib.crc32(t.to_bytes(4, "little"), h)
    return h


class FakeCache:
    """CacheManager with slots, KV blocks of block_len positions and optional cached prefixes."""

    def __init__(self, num_slots=8, block_len=16, num_blocks=1024, prefixes=None) -> None:
        self.num_slots, self.block_len, self.num_blocks = num_slots, block_len, num_blocks
        self.prefixes = dict(prefixes or {})  # tuple(prefix tokens) -> restored length
        self.refuse: set[str] = set()  # ids whose admit answers None (no room), to test FCFS
        self.free_slots = list(range(num_slots))[::-1]
        self.free_blocks = num_blocks
        self.slots: dict[str, int] = {}
        self.blocks: dict[str, int] = {}
        self.state: dict[str, tuple[int, int]] = {}  # positions fed, hash of them (the "state")

    def check(self) -> None:
        assert self.free_blocks >= 0
        assert self.free_blocks + sum(self.blocks.values()) == self.num_blocks
        assert len(self.free_slots) + len(self.slots) == self.num_slots
        assert len(set(self.slots.values())) == len(self.slots), "a slot given twice"
        assert set(self.blocks) == set(self.slots) == set(self.state)

    def holds(self, rid: str) -> bool:
        return rid in self.slots or rid in self.blocks or rid in self.state

    def all_free(self) -> bool:
        return self.free_blocks == self.num_blocks and len(self.free_slots) == self.num_slots

    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_len

    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def admit(self, rid: str, token_ids: list[int], reuse: bool = True) -> int | None:
        assert rid not in self.slots, f"double admission of {rid}"
        if not self.free_slots or rid in self.refuse:
            return None
        hits = [
            n
            for key, n in self.prefixes.items()
            if reuse and len(key) < len(token_ids) and tuple(token_ids[: len(key)]) == key
        ]
        restored = max(hits, default=0)
        need = math.ceil(restored / self.block_len)
        if need > self.free_blocks:
            return None
        self.slots[rid] = self.free_slots.pop()
        self.blocks[rid] = need
        self.free_blocks -= need
        self.state[rid] = (restored, fold(0, token_ids[:restored]))
        self.check()
        return restored

    def slot_of(self, rid: str) -> int:
        return self.slots[rid]

    def reserve(self, rid: str, num_positions: int) -> bool:
        assert rid in self.slots, f"reserve for {rid}, which holds no slot"
        assert num_positions <= self.capacity_tokens()
        need = math.ceil(num_positions / self.block_len) - self.blocks[rid]
        if need > self.free_blocks:
            return False
        if need > 0:
            self.blocks[rid] += need
            self.free_blocks -= need
        self.check()
        return True

    def release(self, rid: str) -> None:
        assert rid in self.slots, f"release of {rid}, which holds nothing"
        self.free_slots.append(self.slots.pop(rid))
        self.free_blocks += self.blocks.pop(rid)
        del self.state[rid]
        self.check()


def execute(cache: FakeCache, plan: StepPlan) -> dict[str, int]:
    """The fake runner: feed each chunk into its slot's state, sample where asked."""
    sampled = {}
    for c in plan.chunks:
        assert cache.slots[c.request_id] == c.slot
        pos, h = cache.state[c.request_id]
        end = c.start_pos + len(c.token_ids)
        assert c.start_pos == pos, "chunk does not continue the slot's state"
        assert cache.blocks[c.request_id] * cache.block_len >= end, "KV not reserved"
        h = fold(h, c.token_ids)
        cache.state[c.request_id] = (end, h)
        if c.sample:
            sampled[c.request_id] = h % 1000
    return sampled


class Engine:
    """The engine loop around the scheduler; checks every plan and records the chunks."""

    def __init__(self, config: SchedulerConfig, cache: FakeCache) -> None:
        self.config, self.cache = config, cache
        self.sched = Scheduler(config, cache)
        self.reqs: dict[str, Request] = {}
        self.plans: list[StepPlan] = []
        self.chunks: dict[str, list[ScheduledChunk]] = defaultdict(list)

    def add(self, rid: str, prompt, max_new: int) -> Request:
        req = Request(rid, list(prompt), max_new)
        self.sched.add(req)
        self.reqs[rid] = req
        return req

    def step(self) -> StepPlan:
        running = [r for r in self.reqs.values() if r.status is Status.RUNNING]
        plan = self.sched.schedule()
        self.check_plan(plan, sorted(running, key=lambda r: r.arrival))
        self.sched.update(plan, execute(self.cache, plan))
        for c in plan.chunks:
            self.chunks[c.request_id].append(c)
            req = self.reqs[c.request_id]
            if req.status is not Status.FINISHED and len(req.output_ids) >= req.max_new_tokens:
                self.sched.finish(c.request_id, "length")
        self.plans.append(plan)
        self.cache.check()
        return plan

    def run(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work:
                return
            self.step()
        raise AssertionError("did not finish")

    def check_plan(self, plan: StepPlan, running_before: list[Request]) -> None:
        cfg = self.config
        ids = [c.request_id for c in plan.chunks]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        assert plan.num_tokens <= cfg.max_num_batched_tokens
        for c in plan.chunks:
            req = self.reqs[c.request_id]
            end = c.start_pos + len(c.token_ids)
            assert req.status is Status.RUNNING and c.start_pos == req.num_computed
            assert 1 <= len(c.token_ids) <= cfg.max_prefill_chunk
            assert c.token_ids == tuple(req.all_ids[c.start_pos : end])
            assert c.sample == (end == len(req.all_ids))
            assert end <= len(req.prompt_ids) + req.max_new_tokens
            if not c.sample:
                assert end % cfg.chunk_align == 0, f"unaligned early stop at {end}"
        # victims are the newest running requests, newest first, and none of them runs this step
        newest_first = [r.request_id for r in reversed(running_before)]
        assert list(plan.preempted) == newest_first[: len(plan.preempted)]
        assert not set(plan.preempted) & set(ids)
        holding = [r for r in self.reqs.values() if r.status in (Status.RUNNING, Status.PARKED)]
        assert len(holding) <= cfg.max_num_seqs

    def fed(self, rid: str) -> tuple[int, list[int]]:
        """(start, tokens) of the request's last life (since its last admission); contiguous."""
        start, tokens, end = 0, [], None
        for c in self.chunks[rid]:
            if end is None or c.start_pos != end:  # a new life: (re)admitted after preemption
                assert end is None or c.start_pos < end
                start, tokens = c.start_pos, []
            tokens += c.token_ids
            end = c.start_pos + len(c.token_ids)
        return start, tokens


def solo_outputs(prompt, max_new: int) -> list[int]:
    eng = Engine(SchedulerConfig(), FakeCache(num_slots=1, num_blocks=4096))
    req = eng.add("solo", prompt, max_new)
    eng.run()
    return req.output_ids


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


SMALL = SchedulerConfig(
    max_num_seqs=8, max_num_batched_tokens=256, max_prefill_chunk=128, chunk_align=32
)


def assert_done_like_solo(eng: Engine, rids) -> None:
    for rid in rids:
        req = eng.reqs[rid]
        assert req.status is Status.FINISHED and req.finish_reason == "length"
        assert req.output_ids == solo_outputs(req.prompt_ids, req.max_new_tokens), rid
        start, tokens = eng.fed(rid)
        # every token but the last sampled one went through the runner exactly once, in order
        assert tokens == req.all_ids[start:-1]
        assert not eng.cache.holds(rid)
    assert eng.cache.all_free()


@pytest.mark.parametrize(
    "kwargs,word",
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_waiting": -1}, "max_waiting"),
        ({"chunk_align": 1.5}, "chunk_align"),
        ({"max_prefill_chunk": 32, "chunk_align": 64}, "max_prefill_chunk"),
        ({"max_num_batched_tokens": 32, "chunk_align": 64}, "max_num_batched_tokens"),
    ],
)
def test_config_validation(kwargs, word) -> None:
    with pytest.raises(ValueError, match=word):
        SchedulerConfig(**kwargs)


def test_budget_chunking_and_outputs_match_solo() -> None:
    eng = Engine(SMALL, FakeCache(num_slots=8, num_blocks=1024))
    shapes = [(1, 4), (5, 1), (31, 9), (32, 3), (33, 12), (100, 20), (300, 7), (700, 15), (129, 2)]
    for i, (n, m) in enumerate(shapes[:6]):
        eng.add(f"r{i}", prompt_of(i, n), m)
    for _ in range(3):  # later arrivals join a batch already decoding
        eng.step()
    for i, (n, m) in enumerate(shapes[6:], start=6):
        eng.add(f"r{i}", prompt_of(i, n), m)
    eng.run()
    busiest = max(p.num_tokens for p in eng.plans)  # the budget was binding (up to alignment)
    assert (
        SMALL.max_num_batched_tokens - SMALL.chunk_align < busiest <= SMALL.max_num_batched_tokens
    )
    assert max(len(c.token_ids) for p in eng.plans for c in p.chunks) == SMALL.max_prefill_chunk
    assert_done_like_solo(eng, eng.reqs)


def test_decodes_are_not_starved_by_long_prompts() -> None:
    cfg = SchedulerConfig()  # 2048 budget, 512 chunks: four long prompts could fill a step alone
    eng = Engine(cfg, FakeCache(num_slots=8, num_blocks=2048))
    d = eng.add("d", prompt_of(0, 10), 40)
    eng.step()
    assert len(d.output_ids) == 1  # prefilled: decoding from now on
    for i in range(5):
        eng.add(f"long{i}", prompt_of(i + 1, 3000), 2)
    contended = 0
    while d.status is not Status.FINISHED:
        before = len(d.output_ids)
        plan = eng.step()
        mine = [c for c in plan.chunks if c.request_id == "d"]
        assert len(mine) == 1 and len(mine[0].token_ids) == 1 and mine[0].sample
        assert len(d.output_ids) == before + 1
        contended += plan.num_tokens > cfg.max_num_batched_tokens - cfg.chunk_align
    assert contended >= 5  # the long prompts really competed for the budget
    eng.run()
    assert_done_like_solo(eng, eng.reqs)


def test_fcfs_admission_and_seq_limit() -> None:
    cfg = SchedulerConfig(
        max_num_seqs=2, max_num_batched_tokens=256, max_prefill_chunk=64, chunk_align=16
    )
    eng = Engine(cfg, FakeCache(num_slots=4))
    for i, m in enumerate([3, 6, 2, 2]):
        eng.add(f"r{i}", prompt_of(i, 20), m)
    plan = eng.step()
    assert [c.request_id for c in plan.chunks] == ["r0", "r1"]
    assert (eng.sched.num_running, eng.sched.num_waiting) == (2, 2)
    first_seen = {}
    while eng.sched.has_work:
        plan = eng.step()
        for c in plan.chunks:
            first_seen.setdefault(c.request_id, len(eng.plans))
        assert eng.sched.num_running <= 2
    # r0 finishes first, r2 takes its place (not r3, and not later than needed)
    assert first_seen["r2"] == 4 and first_seen["r3"] > first_seen["r2"]
    assert_done_like_solo(eng, eng.reqs)


def test_slot_limit_and_head_of_line_blocking() -> None:
    cache = FakeCache(num_slots=2)
    eng = Engine(SMALL, cache)
    for i in range(4):
        eng.add(f"r{i}", prompt_of(i, 20), 3)
    eng.step()
    assert eng.sched.num_running == 2 and cache.num_free_slots() == 0
    cache.refuse.add("r2")  # the head cannot be admitted: r3 must not overtake it
    while eng.reqs["r0"].status is not Status.FINISHED:
        eng.step()
    eng.step()
    assert cache.num_free_slots() > 0 and eng.reqs["r3"].status is Status.WAITING
    cache.refuse.clear()
    eng.step()
    assert eng.reqs["r2"].status is Status.RUNNING
    eng.run()
    assert_done_like_solo(eng, eng.reqs)


def test_preemption_recomputes_and_matches_unpressured_run() -> None:
    cfg = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=128, max_prefill_chunk=32, chunk_align=16
    )
    cache = FakeCache(num_slots=4, block_len=16, num_blocks=12)  # 192 positions for everyone
    eng = Engine(cfg, cache)
    eng.add("a", prompt_of(1, 150), 30)  # long prefill in chunks, older than everyone
    eng.add("b", prompt_of(2, 20), 40)  # decoding while a still prefills
    eng.add("c", prompt_of(3, 10), 40)
    eng.run()
    preempted = [rid for p in eng.plans for rid in p.preempted]
    assert preempted and "a" not in preempted  # the oldest is never the victim here
    b = eng.reqs["b"]
    assert b.num_preemptions >= 1
    chunks = eng.chunks["b"]
    i = next(i for i, c in enumerate(chunks) if i and c.start_pos == 0)  # recompute from scratch
    done_before = chunks[i - 1].start_pos + len(chunks[i - 1].token_ids)
    assert done_before > len(b.prompt_ids)  # it had outputs when preempted
    # the recompute replays prompt + kept outputs, then samples the next token
    first_sample = next(c for c in chunks[i:] if c.sample)
    assert first_sample.start_pos + len(first_sample.token_ids) == done_before + 1
    assert_done_like_solo(eng, eng.reqs)


def test_prefix_hit_starts_at_restored_position() -> None:
    prompt = prompt_of(7, 200)
    cache = FakeCache(prefixes={tuple(prompt[:64]): 64, tuple(prompt_of(8, 64)): 64})
    eng = Engine(SMALL, cache)
    req = eng.add("p", prompt, 5)
    plan = eng.step()
    assert plan.chunks[0].start_pos == 64 and plan.chunks[0].token_ids[0] == prompt[64]
    assert req.num_restored == 64
    eng.run()
    assert_done_like_solo(eng, ["p"])


def test_abort_in_every_state_releases_everything() -> None:
    cfg = SchedulerConfig(
        max_num_seqs=2, max_num_batched_tokens=256, max_prefill_chunk=64, chunk_align=16
    )
    cache = FakeCache(num_slots=4)
    eng = Engine(cfg, cache)
    for rid in ("run", "park", "wait", "keep"):
        eng.add(rid, prompt_of(len(rid), 40), 50)
    eng.step()
    eng.sched.park("park")
    assert cache.holds("park") and eng.reqs["wait"].status is Status.WAITING
    for rid in ("wait", "park"):
        req = eng.sched.abort(rid)
        assert req.status is Status.FINISHED and req.finish_reason == "abort"
        assert not cache.holds(rid) and eng.sched.abort(rid) is None
    plan = eng.sched.schedule()  # "keep" is admitted in the parked request's place
    sampled = execute(cache, plan)
    assert {c.request_id for c in plan.chunks} == {"run", "keep"}
    assert eng.sched.abort("run").finish_reason == "abort"
    eng.sched.update(plan, sampled)  # a plan made before the abort must not resurrect it
    assert eng.reqs["run"].status is Status.FINISHED and not cache.holds("run")
    with pytest.raises(KeyError):
        eng.sched.get("run")
    with pytest.raises(RequestError, match="unknown or finished"):
        eng.sched.park("run")
    again = Request("run", prompt_of(9, 40), 5)  # a finished id may be reused ...
    eng.sched.add(again)
    old = StepPlan(tuple(c for c in plan.chunks if c.request_id == "run"), ())
    eng.sched.update(old, sampled)  # ... and an old plan does not touch the new request
    assert again.num_computed == 0 and not again.output_ids
    eng.sched.abort("run")
    assert eng.reqs["keep"].num_computed == 40  # the other chunk of that plan still counted
    assert eng.sched.abort("nope") is None
    eng.run()
    assert eng.reqs["keep"].finish_reason == "length" and cache.all_free()


def test_park_and_resume_continue_exactly() -> None:
    eng = Engine(SMALL, FakeCache(num_slots=4))
    a, b = eng.add("a", prompt_of(1, 50), 12), eng.add("b", prompt_of(2, 60), 12)
    with pytest.raises(RequestError, match="parked"):
        eng.sched.park("a")  # still waiting
    for _ in range(3):
        eng.step()
    eng.sched.park("a")
    slot, computed = eng.cache.slot_of("a"), a.num_computed
    with pytest.raises(RequestError):
        eng.sched.resume("b")
    for _ in range(4):
        assert "a" not in {c.request_id for c in eng.step().chunks}
    assert (a.status, a.num_computed, eng.cache.slot_of("a")) == (Status.PARKED, computed, slot)
    assert eng.sched.num_parked == 1
    eng.run()  # b finishes; a, parked, is not work
    assert b.status is Status.FINISHED and a.status is Status.PARKED
    eng.sched.resume("a")
    eng.run()
    assert_done_like_solo(eng, ["a", "b"])


def test_parked_request_is_never_preempted() -> None:
    cfg = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=64, chunk_align=16
    )
    cache = FakeCache(num_slots=4, block_len=16, num_blocks=8)
    eng = Engine(cfg, cache)
    a = eng.add("a", prompt_of(1, 64), 30)
    eng.step()
    eng.sched.park("a")  # holds 4 blocks + slot
    b = eng.add("b", prompt_of(2, 64), 60)  # grows past the 4 blocks left
    for _ in range(40):
        eng.step()
    assert a.status is Status.PARKED and cache.holds("a") and b.num_preemptions >= 1
    eng.sched.resume("a")
    eng.run()
    assert_done_like_solo(eng, ["a", "b"])


def test_never_schedules_past_max_new_tokens() -> None:
    cache = FakeCache()
    sched = Scheduler(SMALL, cache)
    req = Request("a", prompt_of(1, 10), 2)
    sched.add(req)
    for _ in range(4):  # an engine that forgets to finish it
        plan = sched.schedule()
        sched.update(plan, execute(cache, plan))
    assert len(req.output_ids) == 2 and req.num_computed == 11 and sched.schedule().is_empty
    assert sched.finish("a", "length") is req and cache.all_free()
    with pytest.raises(ValueError, match="finish reason"):
        sched.finish("a", "eos")


def test_capacity_errors_and_queue_bound() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=64, max_prefill_chunk=64, chunk_align=16, max_waiting=2
    )
    cache = FakeCache(num_slots=2, block_len=16, num_blocks=4)  # 64 positions per sequence
    eng = Engine(cfg, cache)
    with pytest.raises(CapacityError, match="KV pool holds at most 64"):
        eng.add("huge", prompt_of(0, 64), 1)
    eng.add("a", prompt_of(1, 10), 3)
    with pytest.raises(RequestError, match="already in use"):
        eng.add("a", prompt_of(1, 10), 3)
    eng.add("b", prompt_of(2, 63), 100)  # fits; cannot outgrow the pool: capped at 2 tokens
    with pytest.raises(CapacityError, match="queue is full"):
        eng.add("c", prompt_of(3, 10), 3)
    assert eng.reqs["b"].max_new_tokens == 2
    eng.run()
    eng.add("c", prompt_of(3, 10), 3)  # room again once the queue drains
    eng.run()
    assert_done_like_solo(eng, ["a", "b", "c"])


def test_update_rejects_missing_samples_and_stale_plans() -> None:
    eng = Engine(SMALL, FakeCache())
    req = eng.add("a", prompt_of(1, 10), 3)
    plan = eng.sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        eng.sched.update(plan, {})
    assert req.num_computed == 0  # a rejected update changes nothing
    eng.sched.update(plan, execute(eng.cache, plan))
    with pytest.raises(ValueError, match="stale plan"):
        eng.sched.update(plan, {"a": 1})
    assert plan.num_tokens == 10 and not plan.is_empty and eng.sched.schedule().num_tokens == 1


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_invariants_and_frees_everything(seed: int) -> None:
    rng = random.Random(seed)
    cfg = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_prefill_chunk=32,
        chunk_align=8,
        max_waiting=6,
    )
    eng = Engine(cfg, FakeCache(num_slots=4, block_len=8, num_blocks=40))
    for step in range(300):
        if rng.random() < 0.3:
            try:
                eng.add(f"r{step}", prompt_of(step, rng.randint(1, 120)), rng.randint(1, 30))
            except CapacityError:
                pass
        live = [r for r in eng.reqs.values() if r.status is not Status.FINISHED]
        if live and rng.random() < 0.05:
            eng.sched.abort(rng.choice(live).request_id)
        if live and rng.random() < 0.1:
            req = rng.choice(live)
            if req.status is Status.RUNNING:
                eng.sched.park(req.request_id)
            elif req.status is Status.PARKED:
                eng.sched.resume(req.request_id)
        eng.step()
    for req in eng.reqs.values():
        if req.status is Status.PARKED:
            eng.sched.resume(req.request_id)
    eng.run()
    done = [rid for rid, r in eng.reqs.items() if r.finish_reason == "length"]
    assert len(done) > 10
    assert_done_like_solo(eng, done)
