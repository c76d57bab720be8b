"""/v1/responses (stateless) as the `openai` client's responses.create meets it: the same tokens
as the chat request it means, the streamed events adding up to the whole response (the client's
own accumulator), a function tool round trip, and 400s for what is never stored."""

from __future__ import annotations

import httpx
import pytest

from deltaserve.server.app import build_app
from tests.server.helpers import app_server

TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                       "required": ["city"]}}


@pytest.fixture(scope="module")
def base(tiny_llm):
    with app_server(build_app(tiny_llm, served_name="tiny")) as url:
        yield url


def _client(base):
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key="none")


def _final(events):
    """The streamed response as its last event carries it (the client's get_final_response
    takes response.completed only; a max_output_tokens stop ends with response.incomplete)."""
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events[-1].response


def test_plain_and_streamed_responses_are_the_chat_answer(base) -> None:
    client = _client(base)
    kwargs = dict(model="tiny", instructions="Be brief.", input="Name a color.",
                  max_output_tokens=10, temperature=0, reasoning={"effort": "none"})
    whole = client.responses.create(store=False, **kwargs)
    chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Name a color."}],
        "max_tokens": 10, "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert whole.output_text == chat["choices"][0]["message"]["content"]
    assert whole.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert whole.usage.output_tokens == chat["usage"]["completion_tokens"]
    length = chat["choices"][0]["finish_reason"] == "length"
    assert whole.status == ("incomplete" if length else "completed")
    assert whole.id.startswith("resp_") and whole.object == "response"
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = _final(events)
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    thinking = dict(model="tiny", input="Why is the sky blue?", max_output_tokens=6,
                    temperature=0)  # thinking on (the template's default): reasoning items
    whole = client.responses.create(**thinking)
    with client.responses.stream(**thinking) as stream:
        final = _final(list(stream))
    assert whole.status == final.status == "incomplete"
    assert [o.type for o in whole.output] == [o.type for o in final.output] == ["reasoning"]
    assert final.output[0].content[0].text.rstrip("\n") == whole.output[0].content[0].text


def test_a_function_tool_round_trip(base) -> None:
    client = _client(base)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.responses.create(model="tiny", input=ask, tools=[TOOL], temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=300, reasoning={"effort": "none"})
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    import json

    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    with client.responses.stream(model="tiny", input=ask, tools=[TOOL], temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=300, reasoning={"effort": "none"}) as stream:
        final = stream.get_final_response()
    assert [(o.name, o.arguments) for o in final.output if o.type == "function_call"] == \
        [(calls[0].name, calls[0].arguments)]
    follow = [*ask, {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                     "arguments": calls[0].arguments},
              {"type": "function_call_output", "call_id": calls[0].call_id,
               "output": "Sunny, 21 C"}]
    answer = client.responses.create(model="tiny", input=follow, tools=[TOOL],
                                     max_output_tokens=4, reasoning={"effort": "none"})
    assert answer.usage.input_tokens > first.usage.input_tokens


def test_what_is_never_stored_or_built_is_a_400(base) -> None:
    from openai import BadRequestError

    client = _client(base)
    for kwargs, what in ((dict(store=True), "not stored"),
                         (dict(previous_response_id="resp_1"), "not stored"),
                         (dict(tools=[{"type": "web_search"}]), "tools are not supported"),
                         (dict(background=True), "background")):
        with pytest.raises(BadRequestError, match=what):
            client.responses.create(model="tiny", input="hi", max_output_tokens=2, **kwargs)
