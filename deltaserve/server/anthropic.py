"""Anthropic's Messages API on the chat pipeline: /v1/messages (whole or streamed as its events)
and /v1/messages/count_tokens. A request becomes the chat request it means (system, text and
image blocks, tool_use / tool_result turns, tools and tool_choice, stop_sequences, thinking), runs
as one, and its answer becomes a message: thinking, text and tool_use blocks, stop_reason, usage.

Thinking is off unless the request enables it (Anthropic's default; Qwen3.5's template default is
on). `thinking.budget_tokens` is checked as Anthropic checks it but not enforced apart from
max_tokens, which bounds thinking and answer together. `cache_control` marks are accepted: the
exact prefix-state cache needs no marks (every prompt prefix is cached)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from deltaserve.server.errors import ApiError
from deltaserve.server.prepare import validated
from deltaserve.server.protocol import ChatCompletionRequest

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # else end_turn/stop_sequence


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None  # user_id for the caller's records: no effect here
    service_tier: str | None = None  # no tiers here: every request is served alike
    cache_control: dict[str, Any] | None = None  # the prefix cache is automatic: no effect


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request `req` means; a construct with no meaning here is a 400 naming it."""
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req)}
    thinking = _thinking(req)
    body["chat_template_kwargs"] = {"enable_thinking": thinking}
    if req.tools:
        body["tools"] = [_tool(t) for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"], parallel = _tool_choice(req.tool_choice)
        body["parallel_tool_calls"] = parallel
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stream=req.stream, stop=req.stop_sequences,
                    temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
        if req.stream:
            body["stream_options"] = {"include_usage": True}
    return validated(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})


def _thinking(req: CountTokensRequest) -> bool:
    spec = req.thinking or {"type": "disabled"}
    kind = spec.get("type")
    if kind == "disabled":
        return False
    if kind != "enabled":
        raise ApiError(400, "thinking.type must be enabled or disabled", param="thinking")
    budget = spec.get("budget_tokens")
    if not isinstance(budget, int) or budget < 1024:
        raise ApiError(400, "thinking.budget_tokens must be an integer >= 1024",
                       param="thinking.budget_tokens")
    if isinstance(req, MessagesRequest) and budget >= req.max_tokens:
        raise ApiError(400, "thinking.budget_tokens must be less than max_tokens",
                       param="thinking.budget_tokens")
    return True


def _text(content, where: str) -> str:
    """A system prompt or tool result: a string or text blocks."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content or ():
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ApiError(400, f"{where}: only text blocks are supported here, got "
                           f"{block.get('type')!r}", param=where)
        parts.append(block["text"])
    return "\n".join(parts)


def _messages(req: CountTokensRequest) -> list[dict]:
    out: list[dict] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            out.extend(_user_turn(m.content, f"messages.{i}"))
        else:
            out.append(_assistant_turn(m.content, f"messages.{i}"))
    return out


def _user_turn(blocks: list[dict], where: str) -> list[dict]:
    """tool_result blocks become tool messages (first, as they answer the previous turn), text
    and image blocks one user message."""
    tools, parts = [], []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": block.get("text", "")})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, where)}})
        elif kind == "tool_result":
            text = _text(block.get("content") or "", f"{where}.tool_result.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            tools.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                          "content": text})
        else:
            raise ApiError(400, f"{where}: content block type {kind!r} is not supported (text, "
                           "image, tool_result)", param=where)
    return tools + ([{"role": "user", "content": parts}] if parts else [])


def _image_url(block: dict, where: str) -> str:
    source = block.get("source") or {}
    if source.get("type") == "base64":
        return f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    if source.get("type") == "url":
        return str(source.get("url"))  # refused downstream: URLs are not fetched
    raise ApiError(400, f"{where}: image source type {source.get('type')!r} is not supported "
                   "(base64)", param=where)


def _assistant_turn(blocks: list[dict], where: str) -> dict:
    text, reasoning, calls = [], [], []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            text.append(block.get("text", ""))
        elif kind == "thinking":
            reasoning.append(block.get("thinking", ""))
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"), "arguments": json.dumps(block.get("input") or {})}})
        else:
            raise ApiError(400, f"{where}: content block type {kind!r} is not supported in an "
                           "assistant turn (text, thinking, tool_use)", param=where)
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        turn["reasoning_content"] = "".join(reasoning)
    if calls:
        turn["tool_calls"] = calls
    return turn


def _tool(tool: dict) -> dict:
    if tool.get("type") not in (None, "custom"):
        raise ApiError(400, f"tools: server tool {tool.get('type')!r} is not supported; give "
                       "client tools {name, description, input_schema}", param="tools")
    unknown = set(tool) - {"type", "name", "description", "input_schema", "cache_control"}
    if unknown:
        raise ApiError(400, f"tools: {', '.join(sorted(unknown))} not supported", param="tools")
    fn = {"name": tool.get("name"), "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description"):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict) -> tuple[Any, bool]:
    """(chat tool_choice, parallel_tool_calls)."""
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    named = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in named:
        raise ApiError(400, "tool_choice.type must be auto, any, tool or none",
                       param="tool_choice")
    return named[kind], parallel


def _stop(finish: str | None, stop_reason) -> tuple[str, str | None]:
    if finish == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return STOP_REASONS.get(finish or "stop", "end_turn"), None


def message_of(chat: dict, thinking: bool) -> dict:
    """The message of a whole chat completion."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[dict] = []
    if thinking and msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"],
                        "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"] or "{}")})
    reason, sequence = _stop(choice.get("finish_reason"), choice.get("stop_reason"))
    use = chat["usage"]
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
            "model": chat["model"], "content": content, "stop_reason": reason,
            "stop_sequence": sequence, "usage": {"input_tokens": use["prompt_tokens"],
                                                 "output_tokens": use["completion_tokens"]}}


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


async def message_events(chunks: AsyncIterator, model: str, n_prompt: int,
                         thinking: bool) -> AsyncIterator[str]:
    """A chat completion's SSE chunks as Anthropic's events: message_start, one
    content_block_start / _delta... / _stop per thinking, text or tool_use block, message_delta
    (stop_reason, output tokens) and message_stop; a failure mid-stream is an error event."""
    yield _event("message_start", {"message": {
        "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
    blocks = _Blocks()
    finish, stop_reason, n_out = None, None, 0
    async for raw in chunks:
        line = raw.decode() if isinstance(raw, bytes) else raw
        payload = line.strip().removeprefix("data: ")
        if payload == "[DONE]" or not payload.startswith("{"):
            continue
        obj = json.loads(payload)
        if "error" in obj:
            yield _event("error", {"error": {"type": "api_error",
                                             "message": obj["error"]["message"]}})
            return
        if obj.get("usage"):
            n_out = obj["usage"]["completion_tokens"]
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            if thinking and delta.get("reasoning_content"):
                for out in blocks.add("thinking", delta["reasoning_content"]):
                    yield out
            if delta.get("content"):
                for out in blocks.add("text", delta["content"]):
                    yield out
            for call in delta.get("tool_calls") or ():
                for out in blocks.tool(call):
                    yield out
            if choice.get("finish_reason"):
                finish, stop_reason = choice["finish_reason"], choice.get("stop_reason")
    for out in blocks.close():
        yield out
    reason, sequence = _stop(finish, stop_reason)
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": {"output_tokens": n_out}})
    yield _event("message_stop", {})


class _Blocks:
    """The open content block of a streamed message: a delta of another kind closes it."""

    def __init__(self) -> None:
        self.index, self.kind = -1, None

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]

    def _open(self, kind: str, block: dict) -> list[str]:
        out = self.close()
        self.index, self.kind = self.index + 1, kind
        return out + [_event("content_block_start", {"index": self.index,
                                                     "content_block": block})]

    def add(self, kind: str, text: str) -> list[str]:
        out = [] if self.kind == kind else self._open(kind, {
            "type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})})
        delta = {"type": f"{kind}_delta", kind: text}
        return out + [_event("content_block_delta", {"index": self.index, "delta": delta})]

    def tool(self, call: dict) -> list[str]:
        out = []
        if call.get("id"):  # a new call (ours arrive whole: id, name and arguments at once)
            out = self._open("tool_use", {"type": "tool_use", "id": call["id"],
                                          "name": call["function"]["name"], "input": {}})
        args = (call.get("function") or {}).get("arguments")
        if args:
            out.append(_event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": args}}))
        return out


def add_message_routes(app, prep, run_chat, count_chat) -> None:
    """/v1/messages and /v1/messages/count_tokens on the app's chat pipeline: run_chat(request,
    ChatCompletionRequest, size) -> its response; count_chat(ChatCompletionRequest, size) -> the
    prompt's tokens."""
    from deltaserve.server.prompts import body_schema

    @app.post("/v1/messages", openapi_extra=body_schema(MessagesRequest))
    async def messages(request: Request):
        body, size = await prep.body(request, MessagesRequest)
        chat = chat_request(body)
        thinking = bool(chat.chat_template_kwargs["enable_thinking"])
        answer = await run_chat(request, chat, size)
        if isinstance(answer, StreamingResponse):
            events = message_events(answer.body_iterator, answer.served_name, answer.n_prompt,
                                    thinking)
            return StreamingResponse(events, media_type="text/event-stream")
        if not isinstance(answer, JSONResponse) or answer.status_code != 200:
            return answer  # 499: the client went away
        return JSONResponse(message_of(json.loads(answer.body), thinking))

    @app.post("/v1/messages/count_tokens", openapi_extra=body_schema(CountTokensRequest))
    async def count_tokens(request: Request):
        body, size = await prep.body(request, CountTokensRequest)
        return {"input_tokens": await count_chat(chat_request(body), size)}
