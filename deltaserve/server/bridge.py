"""The async bridge: the engine's step loop runs on one thread; request handlers (asyncio) submit
requests and read each API request's events from its one asyncio.Queue (its n choices are n
engine requests feeding that queue). The engine is touched by that thread only: adds and aborts
reach it through a command queue, drained between steps, and what /metrics shows it publishes as
an immutable snapshot after each step (metrics.Gauges).

The queue yields (choice index, item) pairs: per choice ADMITTED (or the admission error, e.g.
CapacityError for a full queue), then StepOutputs until one is finished, or an EngineDead if the
loop failed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from deltaserve.server.metrics import gauges_of

ADMITTED = "admitted"
log = logging.getLogger("deltaserve.server")


class EngineDead(Exception):
    """A request ended by the server, not by the model: the step loop raised (its cause goes to
    the log, not to clients), or the shutdown's drain window passed. A 503, or an error event."""


LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS_S))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out = [f'{name}_bucket{{{labels},le="{b}"}} {c}' for b, c in zip(self.buckets,
                                                                      self.counts, strict=True)]
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        return [*out, f"{name}_sum{{{labels}}} {self.total:.6f}",
                f"{name}_count{{{labels}}} {self.count}"]


@dataclass
class Counters:
    """What /metrics exports (vLLM's names are given in server/app.py)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    aborted: int = 0
    num_steps: int = 0
    ttft: Histogram = field(default_factory=Histogram)  # admission to first token
    itl: Histogram = field(default_factory=Histogram)  # between a request's tokens
    e2e: Histogram = field(default_factory=Histogram)  # admission to the last token
    decode: Histogram = field(default_factory=Histogram)  # first token to the last
    # engine-side totals of models unloaded earlier (the live engine's are added on export)
    unloaded_totals: dict[str, int] = field(default_factory=dict)


class ModelThread(concurrent.futures.Executor):
    """One daemon thread running submitted calls in order (the model's load, its engine's build,
    then the engine loop: server/host.py says why one thread). A daemon, unlike a
    ThreadPoolExecutor worker, so a loop that was never stopped cannot hold the process at exit."""

    def __init__(self, name: str = "deltaserve-model") -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args, kwargs = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # the caller sees it through the future
                future.set_exception(exc)

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._calls.put(None)
        if wait:
            self._thread.join()


class EngineDriver:
    def __init__(self, engine, idle_wait_s: float = 0.05, counters: Counters | None = None,
                 mirror=None, thread: ModelThread | None = None,
                 on_dead: Callable[[EngineDriver], None] | None = None) -> None:
        """mirror: distributed.serve.Mirror under `serve --tp`: every batch of commands this
        loop applies goes to the other ranks first (they step whenever this loop steps).
        thread: the ModelThread to run the loop on; give the one the model was loaded on
        (server/host.py says why). None: a new one. on_dead(driver): called (on the engine
        thread) once the loop has failed and every open request has been ended."""
        self.engine, self.idle_wait_s, self.mirror = engine, idle_wait_s, mirror
        self.on_dead = on_dead
        self.counters = counters or Counters()
        self.error: str | None = None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._unsent: list = []  # commands taken off the queue, not yet sent to the other ranks
        # engine request -> (the handler's loop, its API request's queue, the choice index)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int]] = {}
        # request -> [admitted, last token, first token] at (monotonic s)
        self._times: dict[str, list[float]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._worker = thread
        self._done: concurrent.futures.Future | None = None  # the loop's run on that thread
        self.last_event_at = 0.0  # when a request last got tokens or finished (idle unload)
        # what /metrics reads, replaced (never changed) by the engine thread after each step
        self.gauges = gauges_of(engine)

    def start(self) -> None:
        if self._worker is None:
            self._worker = ModelThread("deltaserve-engine")
        self._done = self._worker.submit(self._run)
        self._done.add_done_callback(self._ended)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Let in-flight requests finish (up to timeout_s), then end the loop."""
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline and self.alive:
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        if self._done is not None:
            concurrent.futures.wait([self._done], timeout=5.0)

    def _ended(self, done: concurrent.futures.Future) -> None:
        """The loop's run ended: an exception that escaped it is the error."""
        if not done.cancelled() and done.exception() is not None and self.error is None:
            exc = done.exception()
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("the engine loop failed: %s", self.error, exc_info=exc)
        if self.error is not None and self.on_dead is not None:
            self.on_dead(self)

    @property
    def alive(self) -> bool:
        return self.error is None and self._done is not None and not self._done.done()

    @property
    def num_open(self) -> int:
        return len(self._streams)

    def submit(self, request_ids: list[str], prompt_ids: list[list[int]], params: list,
               images=None) -> asyncio.Queue:
        """From a handler on the event loop: one API request's choices (engine request ids, each
        one's prompt and SamplingParams) and the one queue all their events go to (images: the
        prompt's engine.request.ImageInputs, or None)."""
        events: asyncio.Queue = asyncio.Queue()
        if not self.alive:  # nobody would ever answer: fail now
            self._dead_on(events, len(request_ids))
            return events
        loop = asyncio.get_running_loop()
        for index, (rid, ids, p) in enumerate(zip(request_ids, prompt_ids, params, strict=True)):
            self._cmds.put(("add", rid, ids, p, loop, events, images, index))
        self._wake.set()
        if not self.alive:  # died meanwhile: its _fail_all may have drained the queue already
            self._dead_on(events, len(request_ids))
        return events

    def _dead_on(self, events: asyncio.Queue, n: int) -> None:
        dead = EngineDead(self.error or "the engine loop has stopped")
        for index in range(n):
            events.put_nowait((index, dead))

    async def call(self, fn):
        """Run fn() on the engine thread between steps (the model is used by that thread only);
        its result, or its exception, comes back here."""
        future = asyncio.get_running_loop().create_future()
        if not self.alive:
            raise EngineDead(self.error or "the engine loop has stopped")
        self._cmds.put(("call", fn, asyncio.get_running_loop(), future, None))
        self._wake.set()
        return await future

    async def call_every_rank(self, fn, llm, *args):
        """fn(llm, *args) on the engine thread, and under `serve --tp` on every rank with its own
        llm (for work that runs the model's collectives, e.g. teacher-forced logprobs); fn must
        be a module-level function. This rank's result (or exception) comes back."""
        future = asyncio.get_running_loop().create_future()
        if not self.alive:
            raise EngineDead(self.error or "the engine loop has stopped")
        self._cmds.put(("call", lambda: fn(llm, *args), asyncio.get_running_loop(), future,
                        (fn, args)))
        self._wake.set()
        return await future

    def abort(self, request_id: str) -> None:
        """Thread-safe; a finished or unknown request is ignored."""
        self._cmds.put(("abort", request_id))
        self._wake.set()

    def cut(self, reason: str) -> None:
        """Thread-safe: end every open request now (aborted in the engine; each gets
        EngineDead(reason)), e.g. when the shutdown's drain window has passed."""
        self._cmds.put(("cut", reason))
        self._wake.set()

    # ---- the engine thread ----

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # the other ranks of `serve --tp` end with this loop
            if self.mirror is not None:
                self.mirror.close(self.error)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain()
                if not self.engine.has_work:
                    self.gauges = gauges_of(self.engine)
                    if self.mirror is not None:
                        self.mirror.idle()
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
                    continue
                events = self.engine.step()
                self.gauges = gauges_of(self.engine)
            except Exception as exc:  # the engine (or the rank group) is in an unknown state
                self.error = f"{type(exc).__name__}: {exc}"
                log.error("the engine failed; ending its %d open requests: %s",
                          len(self._streams), self.error, exc_info=exc)
                self._fail_all()
                return
            self.counters.num_steps += 1
            self.last_event_at = time.monotonic()
            for ev in events:
                self.counters.generation_tokens += len(ev.token_ids)
                self._time(ev)
                if ev.finished:
                    reason = ev.finish_reason or "stop"
                    self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
                self._send(ev.request_id, ev)
                if ev.finished:
                    self._streams.pop(ev.request_id, None)

    def _fail_all(self) -> None:
        """Every open request, and every command still queued, ends with EngineDead."""
        dead = EngineDead("the engine failed while running this request")
        for rid in list(self._streams):
            self._send(rid, dead)
        self._streams.clear()
        for cmd in [*self._unsent, *self._queued()]:
            if cmd[0] == "add":
                cmd[4].call_soon_threadsafe(cmd[5].put_nowait, (cmd[7], dead))
            elif cmd[0] == "call":
                cmd[2].call_soon_threadsafe(_settle, cmd[3], None, dead)

    def _queued(self):
        """The commands queued so far, taken off the queue one by one."""
        while True:
            try:
                yield self._cmds.get_nowait()
            except queue.Empty:
                return

    def _drain(self) -> None:
        cmds = []
        for cmd in self._queued():  # a cut is an abort of every open request, with its reason
            cmds.extend([("abort", rid, cmd[1]) for rid in self._streams] if cmd[0] == "cut"
                        else [cmd])
        if self.mirror is not None and (cmds or self.engine.has_work):
            # before applying: a call every rank makes runs collectives the others must join
            from deltaserve.distributed.serve import wire

            self._unsent = cmds  # a failed broadcast leaves them for _fail_all to answer
            self.mirror.publish([w for w in map(wire, cmds) if w is not None])
            self._unsent = []
        for cmd in cmds:
            if cmd[0] == "add":
                _, rid, ids, params, loop, events, images, index = cmd
                self._streams[rid] = (loop, events, index)
                try:
                    self.engine.add_request(rid, ids, params, images)
                except Exception as exc:  # RequestError / CapacityError: the handler maps it
                    self._send(rid, exc)
                    self._streams.pop(rid, None)
                    continue
                self.counters.prompt_tokens += len(ids)
                self._times[rid] = [time.monotonic(), 0.0, 0.0]
                self._send(rid, ADMITTED)
            elif cmd[0] == "call":
                _, fn, loop, future, _ = cmd
                try:
                    result, error = fn(), None
                except Exception as exc:  # handed to the caller, the loop goes on
                    result, error = None, exc
                loop.call_soon_threadsafe(_settle, future, result, error)
            elif cmd[0] == "abort" and cmd[1] in self._streams:
                if len(cmd) > 2:  # cut: the request hears why
                    self._send(cmd[1], EngineDead(cmd[2]))
                self._abort(cmd[1])

    def _abort(self, rid: str) -> None:
        self.engine.abort(rid)
        self._streams.pop(rid, None)
        self._times.pop(rid, None)
        self.counters.aborted += 1

    def _time(self, ev) -> None:
        times, now = self._times.get(ev.request_id), time.monotonic()
        if times is None:
            return
        if ev.token_ids:
            if times[1] == 0.0:
                self.counters.ttft.observe(now - times[0])
                times[2] = now
            else:
                self.counters.itl.observe(now - times[1])
            times[1] = now
        if ev.finished:
            self.counters.e2e.observe(now - times[0])
            if times[2]:
                self.counters.decode.observe(now - times[2])
            del self._times[ev.request_id]

    def _send(self, rid: str, item) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            loop, events, index = stream
            loop.call_soon_threadsafe(events.put_nowait, (index, item))


def _settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if future.done():  # the caller went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
