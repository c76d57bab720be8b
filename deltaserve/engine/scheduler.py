"""Continuous-batching policy (CPU only): which requests get which tokens in each engine step.

An engine step is ``plan = scheduler.schedule()``, ``runner.execute(plan)``,
``scheduler.update(plan, sampled)``. The scheduler owns request state; slots and KV blocks
belong to the cache manager, reached only through the CacheManager protocol below.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Protocol

from deltaserve.engine.request import Request, Status
from deltaserve.errors import CapacityError, QueueFullError, RequestError

FINISH_REASONS = frozenset({"stop", "length", "abort"})


class CacheManager(Protocol):
    def capacity_tokens(self) -> int:
        """Most positions one sequence can ever hold (the KV pool size)."""

    def num_free_slots(self) -> int:
        """State slots free now."""

    def admit(self, request_id: str, token_ids: list[int], reuse: bool = True) -> int | None:
        """Give the request a state slot, restoring the longest cached prefix of token_ids
        (at most len-1 tokens; none when reuse is off); the number of tokens restored (0 = miss),
        None if no slot/KV now."""

    def slot_of(self, request_id: str) -> int:
        """The state slot the request holds."""

    def reserve(self, request_id: str, num_positions: int) -> bool:
        """Make KV room for positions [0, num_positions); False (nothing changed) if it cannot now."""

    def release(self, request_id: str) -> None:
        """Return the request's slot and KV blocks to the pools."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running + parked requests holding a slot
    max_num_batched_tokens: int = 2048  # per-step token budget shared by prefill chunks and decodes
    max_prefill_chunk: int = 512  # one request's prefill tokens per step
    # prefill chunks that stop before the end end on a multiple of this (prefix snapshots live there)
    chunk_align: int = 64
    max_waiting: int = 256  # bounded queue

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"SchedulerConfig.{f.name} must be a positive integer, got {value!r}"
                )
        for name in ("max_prefill_chunk", "max_num_batched_tokens"):
            if getattr(self, name) < self.chunk_align:
                raise ValueError(
                    f"SchedulerConfig.{name} ({getattr(self, name)}) must be >= chunk_align "
                    f"({self.chunk_align}): a chunk that stops early must reach an aligned position"
                )


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    request_id: str
    slot: int
    token_ids: tuple[int, ...]
    start_pos: int  # absolute position of token_ids[0] (== request.num_computed at schedule time)
    sample: bool  # ends at the request's last known token: the engine samples from its last logits
    num_draft: int = 0  # speculative drafts after the pending token (spec/verify.py appends them)
    # the last num_unread rows' ids are not on the host yet (their token_ids hold 0): the
    # request's unread tokens, which the runner takes from the device (engine/overlap.py)
    num_unread: int = 0


@dataclass(frozen=True, slots=True)
class StepPlan:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]  # request ids preempted (recompute) during this schedule() call

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class _Step:
    """The plan under construction: chunks by request id, preemptions, the token budget left."""

    __slots__ = ("chunks", "preempted", "budget")

    def __init__(self, budget: int) -> None:
        self.chunks: dict[str, ScheduledChunk] = {}
        self.preempted: list[str] = []
        self.budget = budget

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks[chunk.request_id] = chunk
        self.budget -= len(chunk.token_ids)

    def drop(self, request_id: str) -> None:
        chunk = self.chunks.pop(request_id, None)
        if chunk is not None:
            self.budget += len(chunk.token_ids)


def _arrival(req: Request) -> int:
    return req.arrival


def _is_decode(req: Request) -> bool:
    return req.num_computed >= len(req.prompt_ids) and req.num_pending == 1


def _limit(req: Request) -> int:
    """Positions worth computing: the last one yields token max_new_tokens, later ones nothing."""
    return len(req.prompt_ids) + req.max_new_tokens - 1


class Scheduler:
    """FCFS continuous batching with chunked prefill, decode priority and recompute preemption."""

    def __init__(self, config: SchedulerConfig, cache: CacheManager) -> None:
        self.config = config
        self.cache = cache
        # live requests only: finished ones are forgotten, so their ids may be reused
        self._requests: dict[str, Request] = {}
        # by arrival: preempted requests rejoin ahead of newer arrivals
        self._waiting: list[Request] = []
        # by arrival: the last one is the first preemption victim
        self._running: list[Request] = []
        self._parked: dict[str, Request] = {}
        self._next_arrival = 0
        self.num_preemptions_total = 0  # for /metrics

    # ---- requests in and out ----

    def add(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._requests:
            raise RequestError(f"request id {rid!r} is already in use")
        if not request.prompt_ids:
            raise RequestError(f"request {rid!r} has an empty prompt")
        if request.max_new_tokens < 1:
            raise RequestError(
                f"request {rid!r}: max_new_tokens must be >= 1, got {request.max_new_tokens}"
            )
        if request.status is not Status.WAITING or request.num_computed:
            raise RequestError(f"request {rid!r} is not a fresh request ({request.status.value})")
        capacity = self.cache.capacity_tokens()
        needed = len(request.prompt_ids) + 1
        if needed > capacity:
            raise CapacityError(
                f"request {rid!r} needs {needed} positions (prompt of {needed - 1} + 1) "
                f"but the KV pool holds at most {capacity} per sequence"
            )
        if len(self._waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"the queue is full (max_waiting={self.config.max_waiting}); retry later"
            )
        # a sequence cannot outgrow the KV pool: cap its outputs so a "length" stop comes first
        request.max_new_tokens = min(request.max_new_tokens, capacity - len(request.prompt_ids) + 1)
        request.arrival = self._next_arrival
        self._next_arrival += 1
        self._requests[rid] = request
        self._waiting.append(request)

    def finish(self, request_id: str, reason: str) -> Request:
        if reason not in FINISH_REASONS:
            raise ValueError(
                f"finish reason must be one of {sorted(FINISH_REASONS)}, got {reason!r}"
            )
        req = self._live(request_id)
        self._retire(req, reason)
        return req

    def abort(self, request_id: str) -> Request | None:
        req = self._requests.get(request_id)
        if req is None:
            return None
        self._retire(req, "abort")
        return req

    def park(self, request_id: str) -> None:
        req = self._live(request_id)
        if req.status is not Status.RUNNING:
            raise RequestError(
                f"only a running request can be parked; {request_id!r} is {req.status.value}"
            )
        self._running.remove(req)
        req.status = Status.PARKED
        self._parked[request_id] = req

    def resume(self, request_id: str) -> None:
        req = self._live(request_id)
        if req.status is not Status.PARKED:
            raise RequestError(
                f"only a parked request can be resumed; {request_id!r} is {req.status.value}"
            )
        del self._parked[request_id]
        req.status = Status.RUNNING
        bisect.insort(self._running, req, key=_arrival)

    def get(self, request_id: str) -> Request:
        """A live request; KeyError for an unknown or finished id (finished ones are forgotten)."""
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown or finished request {request_id!r}")
        return req

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    # ---- one step ----

    def schedule(self) -> StepPlan:
        step = _Step(self.config.max_num_batched_tokens)
        self._schedule_running(step)
        self._admit_waiting(step)
        return StepPlan(tuple(step.chunks.values()), tuple(step.preempted))

    def update(self, plan: StepPlan, sampled: Mapping[str, int | tuple[int, ...]] | None) -> None:
        """Record what the runner computed; chunks of requests finished since the plan are ignored.
        A chunk with drafts gets a tuple: the accepted drafts and the target's token after them
        (its computed positions: the pending token and the accepted drafts, one per new token).
        sampled None: a launched step (engine/overlap.py) whose tokens are still on the device;
        each sampling chunk's request gets an unread token, read_back() gives its id."""
        applied: list[tuple[Request, ScheduledChunk]] = []
        for chunk in plan.chunks:
            req = self._requests.get(chunk.request_id)
            # a parked request still holds the slot the runner just advanced, so it counts too
            if req is None or req.status not in (Status.RUNNING, Status.PARKED):
                continue
            if chunk.start_pos != req.num_computed:
                raise ValueError(
                    f"stale plan: the chunk for {chunk.request_id!r} starts at {chunk.start_pos} "
                    f"but {req.num_computed} tokens are computed"
                )
            if chunk.sample and sampled is not None and chunk.request_id not in sampled:
                raise ValueError(
                    f"no sampled token for request {chunk.request_id!r}, whose chunk samples"
                )
            applied.append((req, chunk))
        # checked first, applied after: a bad call leaves every request untouched
        for req, chunk in applied:
            if chunk.num_draft:
                tokens = sampled[chunk.request_id]
                req.num_computed += len(tokens)
                req.output_ids.extend(int(t) for t in tokens)
                continue
            req.num_computed += len(chunk.token_ids)
            if chunk.sample and sampled is None:
                req.num_unread += 1
            elif chunk.sample:
                req.output_ids.append(int(sampled[chunk.request_id]))

    def read_back(self, request_id: str, token: int) -> None:
        """The oldest unread token of a request, read back from the device."""
        req = self._live(request_id)
        if req.num_unread < 1:
            raise ValueError(f"request {request_id!r} has no unread token")
        req.output_ids.append(int(token))
        req.num_unread -= 1

    # ---- internals ----

    def _live(self, request_id: str) -> Request:
        req = self._requests.get(request_id)
        if req is None:
            raise RequestError(f"unknown or finished request {request_id!r}")
        return req

    def _schedule_running(self, step: _Step) -> None:
        # decodes first, so long prompts never starve a stream; then prefills, oldest first
        decodes, prefills = [], []
        for r in self._running:
            (decodes if _is_decode(r) else prefills).append(r)
        for req in decodes:  # one token each: the common case, kept lean (host time per step)
            if step.budget <= 0:
                return
            if req.status is not Status.RUNNING or req.num_computed >= _limit(req):
                continue
            if self._reserve(req, req.num_computed + 1, step):
                unread = int(req.num_unread > 0)  # the token is on the device still
                token = 0 if unread else (req.output_ids[-1] if req.output_ids
                                          else req.prompt_ids[-1])
                step.add(ScheduledChunk(req.request_id, self.cache.slot_of(req.request_id),
                                        (token,), req.num_computed, True, num_unread=unread))
        for req in prefills:
            if step.budget <= 0:
                break
            if req.status is not Status.RUNNING:  # preempted earlier in this call
                continue
            n = self._chunk_len(req, step.budget)
            if n > 0 and self._reserve(req, req.num_computed + n, step):
                step.add(self._chunk(req, n))

    def _admit_waiting(self, step: _Step) -> None:
        cfg = self.config
        while (
            self._waiting
            and step.budget > 0
            and self.cache.num_free_slots() > 0
            and len(self._running) + len(self._parked) < cfg.max_num_seqs
        ):
            req = self._waiting[0]
            if req.request_id in step.preempted:  # memory is tight; FCFS keeps the rest behind it
                break
            restored = self.cache.admit(req.request_id, req.key_ids, reuse=not req.full_prefill)
            if restored is None:  # head-of-line: later arrivals do not overtake it
                break
            if not 0 <= restored < req.num_tokens:
                raise RuntimeError(
                    f"cache restored {restored} of {req.num_tokens} tokens of {req.request_id!r}"
                )
            self._waiting.pop(0)
            req.status = Status.RUNNING
            req.num_computed = req.num_restored = restored
            bisect.insort(self._running, req, key=_arrival)
            n = self._chunk_len(req, step.budget)
            if n == 0:  # budget too small for an aligned chunk: it keeps its slot, goes next step
                break
            if not self.cache.reserve(req.request_id, restored + n):
                self._unadmit(req)  # never preempt running work to admit new work
                break
            step.add(self._chunk(req, n))

    def _chunk_len(self, req: Request, budget: int) -> int:
        start = req.num_computed
        pending = min(req.num_tokens, _limit(req)) - start
        if pending <= 0:
            return 0
        n = min(pending, budget)
        if not _is_decode(req):
            n = min(n, self.config.max_prefill_chunk)
        if n < pending:
            # an early stop ends on an aligned position, where the cache can snapshot the prefix
            align = self.config.chunk_align
            n = (start + n) // align * align - start
        return max(n, 0)

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed
        end = start + n
        unread = max(0, end - max(start, req.num_known))  # a recompute over unread tokens
        return ScheduledChunk(
            request_id=req.request_id,
            slot=self.cache.slot_of(req.request_id),
            token_ids=req.token_slice(start, end - unread) + (0,) * unread,
            start_pos=start,
            sample=end == req.num_tokens,
            num_unread=unread,
        )

    def _reserve(self, req: Request, num_positions: int, step: _Step) -> bool:
        """Reserve KV for req, preempting the newest running requests until it fits or req goes."""
        while not self.cache.reserve(req.request_id, num_positions):
            victim = self._running[-1]  # newest by arrival; req itself when it is the newest
            self._preempt(victim, step)
            if victim is req:
                return False
        return True

    def _preempt(self, victim: Request, step: _Step) -> None:
        step.drop(victim.request_id)  # it may hold a chunk from this very step; it must not run
        self.cache.release(victim.request_id)
        self._running.remove(victim)
        victim.status = Status.WAITING
        victim.num_computed = victim.num_restored = 0  # recompute replays prompt + kept outputs
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        bisect.insort(self._waiting, victim, key=_arrival)
        step.preempted.append(victim.request_id)

    def _unadmit(self, req: Request) -> None:
        self.cache.release(req.request_id)
        self._running.remove(req)
        req.status = Status.WAITING
        req.num_computed = req.num_restored = 0
        self._waiting.insert(0, req)

    def _retire(self, req: Request, reason: str) -> None:
        if req.status is Status.WAITING:
            self._waiting.remove(req)
        elif req.status is Status.RUNNING:
            self._running.remove(req)
            self.cache.release(req.request_id)
        elif req.status is Status.PARKED:
            del self._parked[req.request_id]
            self.cache.release(req.request_id)
        req.status = Status.FINISHED
        req.finish_reason = reason
        del self._requests[req.request_id]
