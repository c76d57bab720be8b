"""Tool-call parsing (server/tools.py) on hand-written model outputs, malformed ones included, and
through a choice's output processor: streamed deltas, in every cut of the text, add up to the
whole response."""

from __future__ import annotations

import json
import random

import pytest

from deltaserve.engine.engine import StepOutput
from deltaserve.server.output import ChoiceOutput
from deltaserve.server.tools import ToolCalls, ToolSpec, parse_call

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "scale": {"type": "number"}, "opts": {"type": "object"}, "ids": {"type": "array"},
    "zip": {"type": "string"}, "maybe": {"type": ["integer", "null"]},
    "unit": {"enum": ["C", "F"]}}}
SPEC = ToolSpec({"get_weather": WEATHER, "now": {"type": "object", "properties": {}}})


def call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def split(text: str, spec: ToolSpec = SPEC) -> tuple[str, list[dict]]:
    calls = ToolCalls(spec)
    content, _ = calls.push(text, final=True)
    return content, [c["function"] for c in calls.calls]


def test_arguments_are_typed_by_the_schema() -> None:
    block = call("get_weather", city="Paris", days="3", metric="true", scale="1.5",
                 opts='{"a": [1, 2]}', ids="[4, 5]", zip="01234", maybe="null",
                 unit="\n C ")
    content, calls = split(block)
    assert content == "" and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {
        "city": "Paris", "days": 3, "metric": True, "scale": 1.5, "opts": {"a": [1, 2]},
        "ids": [4, 5], "zip": "01234", "maybe": None,
        "unit": "C"}  # blanks the grammar allows around a non-string value are not part of it
    multi = parse_call("\n<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n"
                       "</function>\n", SPEC)
    assert json.loads(multi["arguments"]) == {"city": "New\nYork"}  # a value keeps its lines
    assert json.loads(split(call("now"))[1][0]["arguments"]) == {}


def test_several_calls_with_text_before_and_after() -> None:
    text = ("Let me check.\n\n" + call("get_weather", city="Oslo") + "\n"
            + call("now") + "\n\nDone.")
    content, calls = split(text)
    assert [c["name"] for c in calls] == ["get_weather", "now"]
    assert content == "Let me check.\n\nDone."
    ids = ToolCalls(SPEC)
    ids.push(text, final=True)
    assert len({c["id"] for c in ids.calls}) == 2 and all(c["id"].startswith("call_")
                                                          for c in ids.calls)
    _, only = split(text, ToolSpec(SPEC.schemas, parallel=False))
    assert [c["name"] for c in only] == ["get_weather"]  # parallel_tool_calls: false


@pytest.mark.parametrize("bad", [
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",  # unclosed
    call("delete_everything", path="/"),  # not one of the tools
    call("get_weather", days="three"),  # not an integer
    call("get_weather", metric="yes"),  # not a boolean
    "<tool_call>\n<function=get_weather>\nhello <parameter=city>\nx\n</parameter>\n</function>"
    "\n</tool_call>",  # text between parameters
    "<tool_call>\nget_weather(city='Paris')\n</tool_call>",  # not the template's layout
    "<tool_call>",
    "plain text with a < and </tool_call> in it",
])
def test_malformed_calls_come_back_as_the_text_they_were(bad) -> None:
    content, calls = split("Sure. " + bad)
    assert calls == [] and content == "Sure. " + bad


def test_a_bad_block_beside_a_good_one() -> None:
    content, calls = split(call("nope") + call("now"))
    assert [c["name"] for c in calls] == ["now"] and content == call("nope")


def events(text: str, cuts: list[int]) -> list:
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return [StepOutput("r", p, (i,), finished=i == len(pieces) - 1,
                       finish_reason="stop" if i == len(pieces) - 1 else None)
            for i, p in enumerate(pieces)]


TEXTS = [
    "I will look it up.\n" + call("get_weather", city="Lima", days="2") + "\n" + call("now"),
    call("get_weather", city="a <tool_call> inside", days="1"),
    "No tools needed: 2 < 3 and <tool_ is not a call.",
    "Trying " + call("nope") + " then " + call("now") + "\nok",
    "<think>\nhmm\n</think>\n\n" + call("now"),
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_add_up_to_the_whole_response(text) -> None:
    whole = ChoiceOutput("chat.completion", False, None, 0, False, tools=SPEC)
    for ev in events(text, []):
        whole.push(ev)
    expected = whole.whole()
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
        out = ChoiceOutput("chat.completion", False, None, 0, False, tools=SPEC)
        deltas = [out.push(ev) for ev in events(text, cuts)]
        assert "".join(d.text for d in deltas) == expected.text, cuts
        streamed = [c["function"] for d in deltas for c in d.tool_calls]
        assert streamed == [c["function"] for c in expected.tool_calls], cuts
        assert [c["index"] for d in deltas for c in d.tool_calls] == list(range(len(streamed)))
        assert deltas[-1].finish_reason == expected.finish_reason
    assert expected.finish_reason == ("tool_calls" if expected.tool_calls else "stop")


def test_a_call_inside_the_think_block_ends_it() -> None:
    """Qwen3.5 may call a tool before closing its think block (vLLM reads the call as the end)."""
    text = "I should look.\n" + call("now")
    out = ChoiceOutput("chat.completion", True, None, 0, False, tools=SPEC)
    for ev in events(text, [3, 15, 20]):
        out.push(ev)
    whole = out.whole()
    assert whole.reasoning == "I should look." and whole.text == ""
    assert [c["function"]["name"] for c in whole.tool_calls] == ["now"]
    plain = ChoiceOutput("chat.completion", True, None, 0, False)  # no tools: all reasoning
    for ev in events(text, [3]):
        plain.push(ev)
    assert plain.whole().reasoning == text
