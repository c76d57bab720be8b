"""OpenAI's Responses API, stateless (`store: false`): /v1/responses on the chat pipeline. Input
text or items (messages with input_text / input_image parts, function_call and
function_call_output items, reasoning items carried to the next assistant turn), `instructions`,
function tools and tool_choice, `text.format` (JSON schema), `reasoning.effort` ("none" or
"minimal": thinking off); the answer as output items (reasoning, message, function_call), whole or
streamed as the API's events. Nothing is stored: `store: true`, `previous_response_id`,
`background` and built-in tools are 400s naming why."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from deltaserve.server.errors import ApiError
from deltaserve.server.prepare import validated
from deltaserve.server.protocol import ChatCompletionRequest


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    store: bool | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None
    # for the caller's records, no effect on the output (as chat's user / metadata)
    metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # every prefix is cached anyway


def chat_request(req: ResponsesRequest) -> tuple[ChatCompletionRequest, bool]:
    """(the chat request `req` means, whether thinking is on)."""
    if req.store:
        raise ApiError(400, "store: responses are not stored here; send store: false",
                       param="store")
    if req.previous_response_id is not None:
        raise ApiError(400, "previous_response_id: responses are not stored here; send the "
                       "earlier items in input", param="previous_response_id")
    effort = (req.reasoning or {}).get("effort")
    thinking = effort not in ("none", "minimal")
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req), "stream": req.stream,
                            "max_tokens": req.max_output_tokens, "temperature": req.temperature,
                            "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
                            "chat_template_kwargs": {"enable_thinking": thinking}}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = [_tool(t) for t in req.tools]
    if isinstance(req.tool_choice, dict):
        if req.tool_choice.get("type") != "function":
            raise ApiError(400, "tool_choice: only function tools exist here", param="tool_choice")
        body["tool_choice"] = {"type": "function",
                               "function": {"name": req.tool_choice.get("name")}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = (req.text or {}).get("format")
    if fmt and fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    elif fmt and fmt.get("type") != "text":
        body["response_format"] = {"type": fmt.get("type")}
    chat = validated(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})
    return chat, thinking


def _messages(req: ResponsesRequest) -> list[dict]:
    out: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions \
        else []
    if isinstance(req.input, str):
        return [*out, {"role": "user", "content": req.input}]
    reasoning = ""  # a reasoning item belongs to the assistant turn that follows it
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "message":
            turn = {"role": item.get("role"), "content": _content(item.get("content"), i)}
            if turn["role"] == "assistant" and reasoning:
                turn["reasoning_content"], reasoning = reasoning, ""
            out.append(turn)
        elif kind == "function_call":
            turn = {"role": "assistant", "content": "", "tool_calls": [{
                "id": item.get("call_id"), "type": "function", "function": {
                    "name": item.get("name"), "arguments": item.get("arguments") or "{}"}}]}
            if reasoning:
                turn["reasoning_content"], reasoning = reasoning, ""
            out.append(turn)
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str)
                        else _content(output, i)})
        elif kind == "reasoning":
            parts = (item.get("content") or []) + (item.get("summary") or [])
            reasoning += "".join(p.get("text", "") for p in parts)
        else:
            raise ApiError(400, f"input.{i}: item type {kind!r} is not supported (message, "
                           "function_call, function_call_output, reasoning)", param="input")
    return out


def _content(content, i: int):
    if isinstance(content, str):
        return content
    parts = []
    for part in content or ():
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise ApiError(400, f"input.{i}: content part {kind!r} is not supported "
                           "(input_text, output_text, input_image with an image_url)",
                           param="input")
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _tool(tool: dict) -> dict:
    if tool.get("type") != "function":
        raise ApiError(400, f"tools: {tool.get('type')!r} tools are not supported here; give "
                       "function tools", param="tools")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _shell(req: ResponsesRequest, model: str, status: str, output: list, usage: dict | None,
           incomplete: bool, rid: str, created: int) -> dict:
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "model": model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature,
            "top_p": req.top_p, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "store": False, "metadata": req.metadata or {},
            "text": req.text or {"format": {"type": "text"}}, "reasoning": req.reasoning,
            "usage": usage}


def _usage(n_in: int, n_out: int) -> dict:
    return {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}


def _reasoning_item(text: str, status: str = "completed", rid: str | None = None) -> dict:
    return {"type": "reasoning", "id": rid or _item_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(text: str, status: str = "completed", rid: str | None = None) -> dict:
    return {"type": "message", "id": rid or _item_id("msg"), "status": status,
            "role": "assistant", "content": [{"type": "output_text", "text": text,
                                              "annotations": []}] if status == "completed"
            else []}


def _call_item(call: dict, status: str = "completed", rid: str | None = None) -> dict:
    return {"type": "function_call", "id": rid or _item_id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "status": status,
            "arguments": call["function"]["arguments"] if status == "completed" else ""}


def response_of(req: ResponsesRequest, chat: dict, thinking: bool) -> dict:
    choice = chat["choices"][0]
    msg = choice["message"]
    output = []
    if thinking and msg.get("reasoning_content"):
        output.append(_reasoning_item(msg["reasoning_content"]))
    if msg.get("content"):
        output.append(_message_item(msg["content"]))
    output += [_call_item(c) for c in msg.get("tool_calls") or ()]
    incomplete = choice.get("finish_reason") == "length"
    use = chat["usage"]
    return _shell(req, chat["model"], "incomplete" if incomplete else "completed", output,
                  _usage(use["prompt_tokens"], use["completion_tokens"]), incomplete,
                  _item_id("resp"), int(time.time()))


class _Events:
    """The stream's events, numbered; the open output item closes when another kind begins."""

    def __init__(self) -> None:
        self.seq, self.output, self.open = 0, [], None  # open: (kind, item, text so far)

    def event(self, name: str, **data) -> str:
        body = {"type": name, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {name}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def close(self) -> list[str]:
        if self.open is None:
            return []
        kind, item, text = self.open
        self.open, index = None, len(self.output)
        if kind == "reasoning":
            done = _reasoning_item(text, rid=item["id"])
            out = [self.event("response.reasoning_text.done", item_id=item["id"],
                              output_index=index, content_index=0, text=text)]
        elif kind == "message":
            done = _message_item(text, rid=item["id"])
            part = done["content"][0]
            out = [self.event("response.output_text.done", item_id=item["id"],
                              output_index=index, content_index=0, text=text, logprobs=[]),
                   self.event("response.content_part.done", item_id=item["id"],
                              output_index=index, content_index=0, part=part)]
        else:
            done = {**item, "arguments": text, "status": "completed"}
            out = [self.event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, arguments=text)]
        self.output.append(done)
        return out + [self.event("response.output_item.done", output_index=index, item=done)]

    def text(self, kind: str, delta: str) -> list[str]:
        out = []
        if self.open is None or self.open[0] != kind:
            out = self.close()
            index = len(self.output)
            maker = _reasoning_item if kind == "reasoning" else _message_item
            item = maker("", status="in_progress")  # a reasoning item holds its empty text
            self.open = (kind, item, "")
            out.append(self.event("response.output_item.added", output_index=index, item=item))
            if kind == "message":
                out.append(self.event("response.content_part.added", item_id=item["id"],
                                      output_index=index, content_index=0, part={
                                          "type": "output_text", "text": "",
                                          "annotations": []}))
        kind_, item, text = self.open
        self.open = (kind_, item, text + delta)
        name = "response.reasoning_text.delta" if kind == "reasoning" else \
            "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + [self.event(name, item_id=item["id"], output_index=len(self.output),
                                 content_index=0, delta=delta, **extra)]

    def call(self, call: dict) -> list[str]:
        out = self.close()
        index, item = len(self.output), _call_item(call, status="in_progress")
        self.open = ("function_call", item, "")
        out.append(self.event("response.output_item.added", output_index=index, item=item))
        args = call["function"]["arguments"]
        self.open = ("function_call", item, args)
        return out + [self.event("response.function_call_arguments.delta", item_id=item["id"],
                                 output_index=index, delta=args)]


async def response_events(req: ResponsesRequest, chunks: AsyncIterator, model: str,
                          n_prompt: int, thinking: bool) -> AsyncIterator[str]:
    """A chat completion's SSE chunks as the Responses API's events: response.created, then per
    output item its added / delta / done events, then response.completed (or .incomplete; a
    failure mid-stream is response.failed)."""
    ev, rid, created = _Events(), _item_id("resp"), int(time.time())
    start = _shell(req, model, "in_progress", [], None, False, rid, created)
    yield ev.event("response.created", response=start)
    yield ev.event("response.in_progress", response=start)
    finish, n_out = None, 0
    async for raw in chunks:
        payload = (raw.decode() if isinstance(raw, bytes) else raw).strip().removeprefix("data: ")
        if not payload.startswith("{"):
            continue
        obj = json.loads(payload)
        if "error" in obj:
            failed = {**_shell(req, model, "failed", ev.output, None, False, rid, created),
                      "error": {"code": "server_error", "message": obj["error"]["message"]}}
            yield ev.event("response.failed", response=failed)
            return
        if obj.get("usage"):
            n_out = obj["usage"]["completion_tokens"]
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            pieces = []
            if thinking and delta.get("reasoning_content"):
                pieces += ev.text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                pieces += ev.text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                pieces += ev.call(call)
            for piece in pieces:
                yield piece
            finish = choice.get("finish_reason") or finish
    for piece in ev.close():
        yield piece
    incomplete = finish == "length"
    final = _shell(req, model, "incomplete" if incomplete else "completed", ev.output,
                   _usage(n_prompt, n_out), incomplete, rid, created)
    yield ev.event("response.incomplete" if incomplete else "response.completed",
                   response=final)


def add_response_routes(app, prep, run_chat) -> None:
    """/v1/responses on the app's chat pipeline (run_chat(request, ChatCompletionRequest, size))."""
    from deltaserve.server.prompts import body_schema

    @app.post("/v1/responses", openapi_extra=body_schema(ResponsesRequest))
    async def responses(request: Request):
        body, size = await prep.body(request, ResponsesRequest)
        chat, thinking = chat_request(body)
        answer = await run_chat(request, chat, size)
        if isinstance(answer, StreamingResponse):
            events = response_events(body, answer.body_iterator, answer.served_name,
                                     answer.n_prompt, thinking)
            return StreamingResponse(events, media_type="text/event-stream")
        if not isinstance(answer, JSONResponse) or answer.status_code != 200:
            return answer
        return JSONResponse(response_of(body, json.loads(answer.body), thinking))
