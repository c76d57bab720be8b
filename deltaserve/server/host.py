"""The served model's life: loaded in the background (the port opens first and /health answers 503
until it is ready), unloaded after an idle spell (freeing its memory), reloaded by the next request.

Requests reach the model through `async with host.use() as (llm, driver)`: that waits for a load in
progress, starts one when the model is unloaded, and keeps the model from being unloaded while the
handler runs. A streamed response outlives its handler; the driver's open streams keep it loaded.

If the engine loop fails, its open requests end with an error, the cause goes to the log, and the
engine is rebuilt on the loaded model (fresh pools; the prefix cache starts empty): /health says
503 only while that runs, and requests arriving meanwhile wait for it. Under `serve --tp` the rank
group ends instead (every rank would have to rebuild together). What clients see of a failure
never names local paths: the log has the details.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable

from deltaserve.server.bridge import Counters, EngineDriver, ModelThread, log
from deltaserve.server.errors import ApiError
from deltaserve.server.metrics import COUNTS

LOADING, READY, UNLOADED, FAILED = "loading", "ready", "unloaded", "failed"
RESTARTING = "restarting"  # the engine failed and is being rebuilt on the loaded model
_PUBLIC = {LOADING: "the model is loading",
           FAILED: "the model failed to load (the server's log says why)",
           RESTARTING: "the engine failed and is being rebuilt"}


class ModelHost:
    def __init__(self, load: Callable[[], object] | None = None, llm=None,
                 idle_unload_s: float | None = None,
                 on_first_load_failed: Callable[[str], None] | None = None,
                 mirror=None) -> None:
        """mirror: the command channel to the other ranks under `serve --tp` (bridge.py)."""
        if (load is None) == (llm is None):
            raise ValueError("ModelHost needs a loader or a loaded LLM, not both")
        self._loader, self.idle_unload_s = load, idle_unload_s
        self._on_first_load_failed, self.mirror = on_first_load_failed, mirror
        self.counters = Counters()  # one set across reloads: /metrics counts stay monotonic
        self.llm, self.driver = llm, None
        self.state = UNLOADED if llm is None else READY
        self.error: str | None = None
        self.max_model_len: int | None = None if llm is None else llm.max_model_len
        self.input_modalities: list[str] | None = None if llm is None else _modalities(llm)
        self.num_loads = 0 if llm is None else 1
        self.num_restarts = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._load_task: asyncio.Task | None = None
        self._users = 0
        self._last_used = time.monotonic()
        self._watcher: asyncio.Task | None = None
        # The model loads, its engine is built and its loop runs on this one thread. CPU torch runs
        # its ops on OpenMP teams, one per calling thread; once a second thread has a team (the
        # loader's, the event loop's zeroing the engine's pools, then the engine's), libgomp stops
        # its workers spinning between ops (more threads than cores), and every op pays a futex
        # wake-up: engine steps measured 2-2.7x slower, native decode calls 1.5x.
        self._model_thread = ModelThread()

    # ---- lifespan ----

    async def start(self) -> None:
        """On the server's event loop, before the port opens: never waits for the load."""
        self._loop = asyncio.get_running_loop()
        if self.llm is not None:
            llm = self.llm  # its engine (pools zeroed by torch ops) is built on the model thread
            await asyncio.get_running_loop().run_in_executor(self._model_thread, _engine_of, llm)
            self._install(llm)
        else:
            self._begin_load()
        if self.idle_unload_s is not None and self._loader is not None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch_idle())

    async def stop(self, drain_s: float = 30.0) -> None:
        """Graceful: in-flight requests finish (up to drain_s), the rest are cut with an error,
        then the loop ends."""
        if self._watcher is not None:
            self._watcher.cancel()
        if self._load_task is not None and not self._load_task.done():
            await asyncio.shield(self._load_task)
        if self.driver is not None:
            await asyncio.to_thread(self.driver.stop, drain_s)
        self._model_thread.shutdown(wait=False)

    def cut(self, reason: str) -> None:
        """Thread-safe: end every open request now with `reason` (the drain window passed)."""
        driver = self.driver
        if driver is not None and driver.num_open:
            log.warning("%s: ending %d open requests", reason, driver.num_open)
            driver.cut(reason)

    # ---- requests ----

    @contextlib.asynccontextmanager
    async def use(self):
        self._users += 1
        try:
            if self.state == UNLOADED:
                log.warning("a request came: reloading the unloaded model")
                self._begin_load()
            if self.state in (LOADING, RESTARTING):
                await asyncio.shield(self._load_task)
            if self.state != READY:
                raise ApiError(503, _PUBLIC[FAILED] if self.state == FAILED
                               else "the model is not loaded; retry")
            if not self.driver.alive:
                raise ApiError(503, _PUBLIC[RESTARTING])
            yield self.llm, self.driver
        finally:
            self._users -= 1
            self._last_used = time.monotonic()

    def health(self) -> tuple[int, str]:
        """(HTTP status, what /health says): no exception text, which may name local paths."""
        if self.state in _PUBLIC:
            return 503, _PUBLIC[self.state]
        if self.state == UNLOADED:  # healthy: the next request loads it
            return 200, "unloaded"
        if not self.driver.alive:
            return 503, _PUBLIC[RESTARTING]
        return 200, "ok"

    # ---- loading and unloading ----

    def _install(self, llm) -> None:
        self.llm, self.max_model_len = llm, llm.max_model_len
        self.input_modalities = _modalities(llm)
        self.driver = EngineDriver(llm.engine, counters=self.counters, mirror=self.mirror,
                                   thread=self._model_thread, on_dead=self._engine_died)
        self.driver.start()
        self.state, self.error = READY, None

    def _engine_died(self, driver: EngineDriver) -> None:
        """From the engine thread, once a failed loop has ended its requests: rebuild (not under
        --tp: there the failure has ended the rank group)."""
        if self.mirror is None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._begin_restart, driver)

    def _begin_restart(self, driver: EngineDriver) -> None:
        if driver is not self.driver or self.state != READY:
            return  # unloaded or stopped meanwhile
        self.state = RESTARTING
        driver.engine = None  # the failed engine's pools go before the new ones are allocated
        self._load_task = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        start, llm = time.monotonic(), self.llm
        try:
            await asyncio.get_running_loop().run_in_executor(self._model_thread,
                                                             _rebuilt_engine, llm)
        except Exception as exc:  # the model itself is suspect: load it again next request
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("rebuilding the engine failed: %s", self.error, exc_info=exc)
            self.counters.unloaded_totals = self.engine_totals()
            self.llm, self.driver = None, None
            self.state = UNLOADED if self._loader is not None else FAILED
            _release_memory()
            return
        self.num_restarts += 1
        self.counters.unloaded_totals = self.engine_totals()  # the failed engine's counts
        self._install(llm)
        log.warning("the engine was rebuilt in %.1f s; serving again", time.monotonic() - start)

    def _begin_load(self) -> None:
        if self._load_task is None or self._load_task.done():
            self.state = LOADING
            self._load_task = asyncio.get_running_loop().create_task(self._load())

    async def _load(self) -> None:
        try:
            llm = await asyncio.get_running_loop().run_in_executor(
                self._model_thread, lambda: _engine_of(self._loader()))
        except Exception as exc:  # the waiting requests get a 503; the log has the cause
            self.error = f"{type(exc).__name__}: {exc}"
            first = self.num_loads == 0
            if not first:  # (a first load's failure is the server's exit message)
                log.error("reloading the model failed: %s", self.error)
            self.state = FAILED if first else UNLOADED  # a failed reload is retried next request
            if first and self._on_first_load_failed is not None:
                self._on_first_load_failed(self.error)
            return
        self.num_loads += 1
        self._install(llm)
        self._last_used = time.monotonic()

    def idle_s(self) -> float:
        """Seconds since the model last had work (0 while it has some)."""
        if self._users or (self.driver is not None and self.driver.num_open):
            return 0.0
        last = max(self._last_used, self.driver.last_event_at if self.driver else 0.0)
        return time.monotonic() - last

    async def _watch_idle(self) -> None:
        tick = min(max(self.idle_unload_s / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(tick)
            if self.state == READY and self.idle_s() >= self.idle_unload_s:
                log.warning("idle for %.0f s: unloading the model (the next request reloads it)",
                            self.idle_s())
                await self.unload()

    def engine_totals(self) -> dict[str, int]:
        """Preemptions and prefix-cache lookups over every load of the model (monotonic)."""
        totals = dict(self.counters.unloaded_totals)
        for key, value in _engine_counts(self.driver).items():
            totals[key] = totals.get(key, 0) + value
        return {k: totals.get(k, 0) for k in COUNTS}

    async def unload(self) -> None:
        self.counters.unloaded_totals = self.engine_totals()
        driver, self.driver, self.llm = self.driver, None, None
        self.state = UNLOADED
        await asyncio.to_thread(driver.stop)
        del driver
        _release_memory()


def _engine_counts(driver) -> dict[str, int]:
    """The engine's totals as its thread last published them (metrics.Gauges)."""
    return {} if driver is None else dict(zip(COUNTS, driver.gauges.counts, strict=True))


def _release_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _modalities(llm) -> list[str]:
    return ["text", "image"] if getattr(llm, "images", None) is not None else ["text"]


def _rebuilt_engine(llm) -> None:
    """A fresh engine on the loaded model (the failed one's pools, graphs and cache dropped)."""
    llm.drop_engine()
    _release_memory()
    _engine_of(llm)


def _engine_of(llm):
    """llm with its engine built (LLM.engine is lazy: the first touch allocates the pools)."""
    llm.engine  # noqa: B018
    return llm
