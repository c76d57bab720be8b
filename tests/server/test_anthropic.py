"""/v1/messages as Anthropic's own Python client meets it: the same tokens as the chat request it
means, streamed events that add up to the whole message, a tool round trip, stop sequences,
count_tokens, and errors in Anthropic's shape."""

from __future__ import annotations

import httpx
import pytest

from deltaserve.server.app import build_app
from tests.server.helpers import app_server

KEY = "k-anthropic"
GREEDY = {"temperature": 0}  # the 2026 client has no temperature argument; older ones send it
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def base(tiny_llm):
    with app_server(build_app(tiny_llm, served_name="tiny", api_key=KEY)) as url:
        yield url


def _client(base):
    from anthropic import Anthropic

    return Anthropic(base_url=base, api_key=KEY)


def _chat(base, **body) -> dict:
    out = httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"temperature": 0, **body}, timeout=60)
    assert out.status_code == 200, out.text
    return out.json()


def test_a_message_is_the_chat_request_it_means(base) -> None:
    client = _client(base)
    msg = client.messages.create(model="tiny", max_tokens=10, extra_body=GREEDY, system="Be brief.",
                                 messages=[{"role": "user", "content": [
                                     {"type": "text", "text": "Name a color."}]}])
    chat = _chat(base, max_tokens=10, chat_template_kwargs={"enable_thinking": False},
                 messages=[{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "Name a color."}])
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert text == chat["choices"][0]["message"]["content"]
    assert msg.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert msg.usage.output_tokens == chat["usage"]["completion_tokens"]
    finish = chat["choices"][0]["finish_reason"]
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
    assert msg.id.startswith("msg_") and msg.role == "assistant" and msg.model == "tiny"
    counted = client.messages.count_tokens(model="tiny", system="Be brief.", messages=[
        {"role": "user", "content": "Name a color."}])
    assert counted.input_tokens == msg.usage.input_tokens


def test_the_stream_adds_up_to_the_whole_message(base) -> None:
    client = _client(base)
    kwargs = dict(model="tiny", max_tokens=12, extra_body=GREEDY,
                  messages=[{"role": "user", "content": "Count to five."}])
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in whole.content if b.type == "text")
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.stop_reason == whole.stop_reason


def test_stop_sequences_say_which_one_stopped(base) -> None:
    client = _client(base)
    kwargs = dict(model="tiny", extra_body=GREEDY, messages=[{"role": "user", "content": "Go on."}])
    text = client.messages.create(max_tokens=16, **kwargs).content[0].text
    stop = text[4:7]
    assert stop.strip()
    msg = client.messages.create(max_tokens=16, stop_sequences=[stop], **kwargs)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[:text.index(stop)]


def test_a_tool_round_trip_whole_and_streamed(base) -> None:
    client = _client(base)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    choice = {"type": "tool", "name": "get_weather"}
    msg = client.messages.create(model="tiny", max_tokens=200, extra_body=GREEDY, tools=[WEATHER],
                                 tool_choice=choice, messages=ask)
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(calls) == 1
    assert calls[0].name == "get_weather" and calls[0].input["city"] in ("Paris", "Rome")
    with client.messages.stream(model="tiny", max_tokens=200, extra_body=GREEDY, tools=[WEATHER],
                                tool_choice=choice, messages=ask) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in streamed] == [(calls[0].name, calls[0].input)]
    turn = [*ask, {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                          "content": "Sunny, 21 C"}]}]
    answer = client.messages.create(model="tiny", max_tokens=6, tools=[WEATHER], messages=turn)
    assert answer.usage.input_tokens > msg.usage.input_tokens
    before = client.messages.count_tokens(model="tiny", tools=[WEATHER], messages=turn)
    turn[-1]["content"][0]["content"] = "Sunny, 21 C, light wind from the west all day"
    after = client.messages.count_tokens(model="tiny", tools=[WEATHER], messages=turn)
    assert after.input_tokens > before.input_tokens == answer.usage.input_tokens


def test_errors_come_in_anthropics_shape(base) -> None:
    import anthropic

    client = _client(base)
    with pytest.raises(anthropic.BadRequestError, match="content block type 'document'"):
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "data": "x"}}]}])
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens must be less"):
        client.messages.create(model="tiny", max_tokens=1100, messages=[
            {"role": "user", "content": "hi"}],
            thinking={"type": "enabled", "budget_tokens": 2048})
    with pytest.raises(anthropic.BadRequestError, match="server tool"):
        client.messages.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": "hi"}],
            tools=[{"type": "web_search_20250305", "name": "web_search"}])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other", max_tokens=4, messages=[
            {"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.AuthenticationError):
        from anthropic import Anthropic

        Anthropic(base_url=base, api_key="wrong").messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    raw = httpx.post(f"{base}/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                     json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert raw.status_code == 400
    assert raw.json()["type"] == "error"
    assert raw.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in raw.json()["error"]["message"]


def test_thinking_on_request_reaches_the_template(base) -> None:
    """Off unless asked (Anthropic's default): the template closes the think block; asked, it
    leaves it open for the model."""
    client = _client(base)
    ask = [{"role": "user", "content": "Why is the sky blue?"}]
    off = client.messages.count_tokens(model="tiny", messages=ask)
    on = client.messages.count_tokens(model="tiny", messages=ask,
                                      thinking={"type": "enabled", "budget_tokens": 1024})
    assert off.input_tokens > on.input_tokens  # the closed empty block


def test_thinking_text_becomes_thinking_blocks_whole_and_streamed() -> None:
    """The chat answer's reasoning as Anthropic's thinking block, then text and tool_use blocks;
    the stream's events build the same message (the client's own accumulator reads them)."""
    import asyncio
    import json

    from anthropic import Anthropic

    from deltaserve.server.anthropic import message_events, message_of

    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": '{"a": 1}'}}
    chunks = [{"delta": {"role": "assistant", "content": ""}},
              {"delta": {"reasoning_content": "Light "}}, {"delta": {"reasoning_content": "scatters."}},
              {"delta": {"content": "Rayleigh."}}, {"delta": {"tool_calls": [call]}},
              {"delta": {}, "finish_reason": "tool_calls", "stop_reason": None}]
    frames = [f"data: {json.dumps({'choices': [{'index': 0, **c}], 'model': 'm'})}\n\n"
              for c in chunks]
    frames += ['data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9}}\n\n',
               "data: [DONE]\n\n"]

    async def source():
        for f in frames:
            yield f

    async def collect():
        return "".join([e async for e in message_events(source(), "m", 7, thinking=True)])

    from fastapi import FastAPI
    from fastapi.responses import Response

    body = asyncio.run(collect())
    replay = FastAPI()  # a server that answers with these events, for the client's own stream
    replay.post("/v1/messages")(lambda: Response(body, media_type="text/event-stream"))
    with app_server(replay) as url:
        with Anthropic(base_url=url, api_key="x").messages.stream(
                model="m", max_tokens=9, messages=[{"role": "user", "content": "?"}]) as stream:
            message = stream.get_final_message()
    whole = message_of({"model": "m", "usage": {"prompt_tokens": 7, "completion_tokens": 9},
                        "choices": [{"finish_reason": "tool_calls", "stop_reason": None,
                                     "message": {"content": "Rayleigh.",
                                                 "reasoning_content": "Light scatters.",
                                                 "tool_calls": [call]}}]}, thinking=True)
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use"]
    assert [b.model_dump(exclude_none=True) for b in message.content] == whole["content"]
    assert (message.stop_reason, message.usage.output_tokens) == ("tool_use", 9)
    assert message.usage.input_tokens == 7
