"""One API request's choices (n >= 1 engine requests on the same prompt) and the responses built
from their events: a whole JSON body, or an SSE stream whose chunks name their choice's index.

A client that goes away, or one choice that fails, aborts every choice still running: a task
waits for the connection's http.disconnect from the moment the choices are submitted, so a
request whose client left is aborted before the engine's next step, streamed or not.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from deltaserve.engine.engine import NO_TOKEN
from deltaserve.errors import QueueFullError
from deltaserve.server.bridge import ADMITTED, EngineDead
from deltaserve.server.errors import ApiError
from deltaserve.server.logprobs import joined
from deltaserve.server.output import ChoiceOutput, Whole
from deltaserve.server.reqlog import request_done
from deltaserve.server.tools import ToolSpec

_GONE = (-1, None)  # the queue's item once the client has disconnected


class ClientGone(Exception):
    """The client disconnected: its requests are aborted and nothing is left to answer."""


class Choices:
    def __init__(self, rid: str, n: int, driver, request) -> None:
        """request: the HTTP request whose disconnect aborts the choices."""
        self.rid, self.driver, self.request = rid, driver, request
        self.started, self.first_at = time.monotonic(), None  # the request log's times
        self.rids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
        self.events: asyncio.Queue = asyncio.Queue()  # (choice index, item): every choice's
        self._early: collections.deque = collections.deque()  # taken while admitting, in order
        self._tasks: list[asyncio.Task] = []

    async def submit(self, ids: list[list[int]], params: list, images=None) -> None:
        """Every choice (ids and params: one each) admitted, or none (the admitted ones are
        aborted) and an ApiError."""
        self.events = self.driver.submit(self.rids, ids, params, images)
        self._tasks = [asyncio.create_task(self._watch())]
        # a choice's first item says whether it was admitted; the events of a choice admitted
        # earlier (or a disconnect) may come before another's, and are kept for next()
        pending, refused = set(range(len(self.rids))), None
        while pending:
            index, item = await self.events.get()
            if index in pending:
                pending.discard(index)
                if item is not ADMITTED and refused is None:
                    refused = item
            else:
                self._early.append((index, item))
                if index == _GONE[0]:
                    break
        if refused is not None:
            self.abort()
            raise _admission_error(refused)

    async def _watch(self) -> None:
        """Waits for http.disconnect (the body was read already: nothing else arrives). The
        server also says so once the response is complete; the choices are finished by then."""
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self.events.put_nowait(_GONE)
        for rid in self.rids:
            self.driver.abort(rid)

    def close(self) -> None:
        """The response is complete: stop watching."""
        for task in self._tasks:
            task.cancel()

    def abort(self) -> None:
        for rid in self.rids:  # finished or unknown ids are ignored by the driver
            self.driver.abort(rid)
        for task in self._tasks:
            task.cancel()

    async def next(self):
        """The next (index, event); the client went away: everything aborted, ClientGone."""
        item = self._early.popleft() if self._early else await self.events.get()
        if item[0] == _GONE[0]:
            self.abort()
            raise ClientGone
        if self.first_at is None:
            self.first_at = time.monotonic()
        return item

    def log(self, status: int, n_prompt: int, n_out: int) -> None:
        request_done(self.rid, status, n_prompt, n_out, self.started, self.first_at)

    def fail_on(self, ev) -> None:
        """A failed choice fails the request: the others are aborted, the status is 5xx."""
        if isinstance(ev, EngineDead):
            self.abort()
            raise ApiError(503, str(ev), "engine_unavailable")
        if ev.finish_reason == "error":
            self.abort()
            if ev.stop_reason == NO_TOKEN:  # the request's own constraints left nothing to draw
                raise ApiError(400, f"the request stopped: {ev.stop_reason}", "no_allowed_token")
            raise ApiError(500, f"the request failed ({ev.stop_reason}) and was stopped; other "
                           "requests are unaffected", "non_finite_logits")


def _admission_error(item) -> ApiError:
    if isinstance(item, QueueFullError):
        return ApiError(503, str(item), "server_overloaded")
    if isinstance(item, EngineDead):
        return ApiError(503, f"the engine is not running: {item}")
    return ApiError(400, str(item))


async def collect(choices: Choices, outputs: list[ChoiceOutput]) -> None:
    """Every choice's events through its output until each has finished."""
    while any(o.finish_reason is None for o in outputs):
        i, ev = await choices.next()
        choices.fail_on(ev)
        outputs[i].push(ev)


def usage(n_prompt: int, n_out: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out}


def choice(kind: str, index: int, text: str, reason: str | None, delta: bool,
           reasoning: str | None = None, tool_calls: list[dict] | None = None,
           stop_reason: str | int | None = None) -> dict:
    """One choice's object; a finished one carries vLLM's stop_reason (the stop string or token
    id that ended it; None for EOS and length)."""
    end = {"stop_reason": stop_reason} if reason is not None else {}
    if kind == "text_completion":
        return {"index": index, "text": text, "logprobs": None, "finish_reason": reason, **end}
    if delta:  # only what this chunk adds
        msg = {k: v for k, v in (("content", text), ("reasoning_content", reasoning),
                                 ("tool_calls", tool_calls)) if v}
        return {"index": index, "delta": msg, "logprobs": None, "finish_reason": reason, **end}
    # with tool calls and no other text, content is null (as OpenAI answers)
    msg = {"role": "assistant", "content": None if tool_calls and not text else text}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in tool_calls]
    return {"index": index, "message": msg, "logprobs": None, "finish_reason": reason, **end}


def response(rid, kind, model, wholes: list[Whole], n_prompt: int,
             heads: list[tuple[str, dict | None]] | None = None) -> dict:
    """The whole response body: each choice's text after its echoed prompt (heads: (text,
    teacher-forced logprobs or None) per choice, or None), and its logprobs when asked (the
    prompt's part first)."""
    built = []
    for i, w in enumerate(wholes):
        head, head_lp = heads[i] if heads else ("", None)
        item = choice(kind, i, head + w.text, w.finish_reason, False, w.reasoning, w.tool_calls,
                      w.stop_reason)
        if w.logprobs is not None:
            item["logprobs"] = joined(head_lp, w.logprobs)
        built.append(item)
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model,
            "choices": built, "usage": usage(n_prompt, sum(len(w.token_ids) for w in wholes))}


@dataclass
class StreamSpec:
    """How a stream renders: its kind, usage, the reasoning split, and for logprobs the
    tokenizer's decode and the alternatives per token (want_logprobs: asked at all); `echo` =
    per choice (its prompt's text, that prompt's logprobs object or None), sent first."""

    kind: str
    model: str
    n_prompt: int
    include_usage: bool = False
    thinking: bool = False
    decode: object = None
    top_k: int = 0
    echo: list[tuple[str, dict | None]] | None = None
    want_logprobs: bool = False
    tools: ToolSpec | None = None

    def output(self, index: int) -> ChoiceOutput:
        """Choice `index`'s output processor (its text offsets start after its echoed prompt)."""
        return ChoiceOutput(self.kind, self.thinking, self.decode, self.top_k,
                            self.want_logprobs, len(self.echo[index][0]) if self.echo else 0,
                            self.tools)


async def sse(choices: Choices, spec: StreamSpec, first=None) -> AsyncIterator[str]:
    kind = spec.kind
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
    created, n_out, n, status = int(time.time()), 0, len(choices.rids), 200
    outputs = [spec.output(i) for i in range(n)]
    open_choices = set(range(n))

    def frame(items, use=None) -> str:
        body = {"id": choices.rid, "object": chunk_kind, "created": created, "model": spec.model,
                "choices": items}
        if spec.include_usage:
            body["usage"] = use
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    try:
        for i in range(n) if kind == "chat.completion" else ():  # the role first, as OpenAI
            yield frame([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        for i in range(n) if spec.echo else ():
            yield frame([{**choice(kind, i, spec.echo[i][0], None, True),
                          "logprobs": spec.echo[i][1]}])
        while open_choices:
            (i, ev), first = (first, None) if first is not None else (
                await choices.next(), None)
            if isinstance(ev, EngineDead) or ev.finish_reason == "error":
                what = str(ev) if isinstance(ev, EngineDead) else (
                    f"the request failed ({ev.stop_reason}) and was stopped")
                code = status = 503 if isinstance(ev, EngineDead) else 500
                err = {"error": {"message": what, "type": "server_error", "code": code}}
                yield f"data: {json.dumps(err)}\n\n"  # mid-stream errors as vLLM sends them
                yield "data: [DONE]\n\n"
                return
            n_out += len(ev.token_ids)
            delta = outputs[i].push(ev)
            if ev.finished:
                open_choices.discard(i)
            if delta.text or delta.reasoning or ev.finished or delta.logprobs or delta.tool_calls:
                item = choice(kind, i, delta.text, delta.finish_reason, True, delta.reasoning,
                              delta.tool_calls, delta.stop_reason)
                if delta.logprobs:
                    item["logprobs"] = delta.logprobs
                yield frame([item])
        if spec.include_usage:
            yield frame([], usage(spec.n_prompt, n_out))
        yield "data: [DONE]\n\n"
    except ClientGone:  # nobody is reading: end quietly (aborted already)
        status = 499
        return
    finally:
        if open_choices:  # the client went away (or the stream failed): free the slots
            choices.abort()
            status = 499 if status == 200 else status
        choices.close()
        choices.log(status, spec.n_prompt, n_out)
