"""One API request's choices share one queue: admission waits for every choice, keeps the events
of choices admitted earlier in order, and a refused choice aborts the others."""

from __future__ import annotations

import asyncio

import pytest

from deltaserve.engine.engine import StepOutput
from deltaserve.errors import QueueFullError
from deltaserve.server.bridge import ADMITTED
from deltaserve.server.errors import ApiError
from deltaserve.server.stream import Choices, ClientGone


class _Driver:
    """Puts a scripted sequence of (index, item) on the request's queue; records aborts."""

    def __init__(self, script) -> None:
        self.script, self.aborted = script, []

    def submit(self, rids, ids, params, images=None) -> asyncio.Queue:
        events: asyncio.Queue = asyncio.Queue()
        for item in self.script:
            events.put_nowait(item)
        return events

    def abort(self, rid) -> None:
        self.aborted.append(rid)


class _Request:
    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}


def _out(rid: str, text: str, finished: bool = False) -> StepOutput:
    return StepOutput(rid, text, (1,), finished, "stop" if finished else None)


def test_events_that_come_before_another_choice_is_admitted_keep_their_order() -> None:
    async def main():
        script = [(0, ADMITTED), (0, _out("r-0", "a")), (1, ADMITTED), (0, _out("r-0", "b")),
                  (1, _out("r-1", "c", True))]
        choices = Choices("r", 2, _Driver(script), _Request())
        await choices.submit([1, 2], [None, None])
        got = [await choices.next() for _ in range(3)]
        choices.close()
        return [(i, ev.text) for i, ev in got]

    assert asyncio.run(main()) == [(0, "a"), (0, "b"), (1, "c")]


def test_a_refused_choice_aborts_the_admitted_ones() -> None:
    async def main():
        driver = _Driver([(0, ADMITTED), (1, QueueFullError("queue full"))])
        choices = Choices("r", 2, driver, _Request())
        with pytest.raises(ApiError) as err:
            await choices.submit([1, 2], [None, None])
        return err.value.status, driver.aborted

    status, aborted = asyncio.run(main())
    assert status == 503 and aborted == ["r-0", "r-1"]


def test_a_disconnect_while_admitting_ends_the_request() -> None:
    async def main():
        driver, request = _Driver([(0, ADMITTED)]), _Request()
        choices = Choices("r", 2, driver, request)
        admit = asyncio.create_task(choices.submit([1, 2], [None, None]))
        await asyncio.sleep(0)
        request.gone.set()
        await admit
        with pytest.raises(ClientGone):
            await choices.next()
        return driver.aborted

    assert set(asyncio.run(main())) == {"r-0", "r-1"}
