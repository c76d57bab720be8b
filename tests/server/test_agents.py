"""Agents' and structured apps' fields through a real server and the real `openai` client: JSON
schemas, regex, choice and grammars (OpenAI's response_format, vLLM's structured_outputs and
guided_* names), tool calls, penalties and token controls; every field the server does not take,
or takes with a bad value, is a 400 that names it. On the embedded default model and on a
synthetic checkpoint with the real Qwen3.5 tokenizer (248k vocabulary) and chat template."""

from __future__ import annotations

import contextlib
import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from tests.conftest import write_variant
from tests.server.helpers import running_server
from tests.structured.schemas import SCHEMAS, finite

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["C", "F"]}}, "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
             "required": ["zone"]}}}]
# random weights write a free string until the token limit, and xgrammar's XML parameter
# strings do not take maxLength: the synthetic checkpoint's tools take bounded values only
BOUNDED_TOOLS = [TOOLS[1], {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {
        "type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}}}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Servers started on first use and kept for the module: name -> (base URL, model name,
    schemas whose every output must validate, tools)."""
    started: dict[str, tuple] = {}
    with contextlib.ExitStack() as stack:
        def get(name: str) -> tuple:
            if name not in started:
                started[name] = _start(name, stack, tmp_path_factory)
            return started[name]

        yield get


def _start(name: str, stack: contextlib.ExitStack, tmp_path_factory) -> tuple:
    if name == "default":
        base, _ = stack.enter_context(running_server("--dtype", "float32",
                                                     "--max-model-len", "1024"))
        return base, "stdlib-19m", SCHEMAS, TOOLS
    # random weights: an unbounded integer can run to the token limit, so only the schemas
    # whose every value is bounded must finish
    model = write_variant(tmp_path_factory.mktemp("agents") / "tiny")
    base, _ = stack.enter_context(running_server("--model", str(model), "--dtype", "float32",
                                                 "--max-model-len", "1024"))
    return base, "tiny", [s for s in SCHEMAS if finite(s)], BOUNDED_TOOLS


@pytest.fixture(params=["default", "tiny"])
def served(request, servers):
    return servers(request.param)


@pytest.fixture
def default_server(servers):
    return servers("default")


def _client(base):
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def _schema_request(client, model: str, i: int, schema: dict, temperature: float):
    if i % 2:  # OpenAI's way
        resp = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"record {i} as JSON"}],
            temperature=temperature, seed=i, max_tokens=400,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        return resp.choices[0].message.content, resp.choices[0].finish_reason
    resp = client.completions.create(  # vLLM's way
        model=model, prompt=f"# record {i}\nrecord = ", temperature=temperature, seed=i,
        max_tokens=400, extra_body={"structured_outputs": {"json": schema}})
    return resp.choices[0].text, resp.choices[0].finish_reason


def test_schema_outputs_validate_in_one_batch_with_free_requests(served) -> None:
    base, model, schemas, _ = served
    client = _client(base)
    jobs = [(i, s, t) for i, s in enumerate(schemas) for t in (0.0, 1.0)]
    free = [f"def f{i}(x):\n" for i in range(4)]

    def plain(prompt: str) -> str:
        return client.completions.create(model=model, prompt=prompt, temperature=0,
                                         max_tokens=24).choices[0].text

    with ThreadPoolExecutor(len(jobs) + len(free)) as pool:
        constrained = [pool.submit(_schema_request, client, model, *job) for job in jobs]
        mixed = [pool.submit(plain, p) for p in free]
        for (i, schema, temperature), fut in zip(jobs, constrained, strict=True):
            text, finish = fut.result()
            assert finish == "stop", (i, temperature, text)
            jsonschema.validate(json.loads(text), schema)
        mixed = [f.result() for f in mixed]
    assert mixed == [plain(p) for p in free]  # free requests: the same text as alone


def test_regex_choice_grammar_and_json_object(default_server) -> None:
    base, model, _, _ = default_server
    client = _client(base)

    def text(**extra) -> str:
        return client.completions.create(model=model, prompt="value = ", max_tokens=60,
                                         temperature=1.0, seed=7, extra_body=extra
                                         ).choices[0].text

    assert re.fullmatch(r"v[0-9]\.[0-9]{1,2}", text(structured_outputs={"regex": r"v[0-9]\.[0-9]{1,2}"}))
    assert re.fullmatch(r"[a-f]{4}", text(guided_regex="[a-f]{4}"))
    assert text(guided_choice=["yes", "no", "maybe"]) in ("yes", "no", "maybe")
    assert text(structured_outputs={"choice": ["red", "green"]}) in ("red", "green")
    assert re.fullmatch(r"\[[0-9](,[0-9])*\]",
                        text(guided_grammar='root ::= "[" d ("," d)* "]"\nd ::= [0-9]'))
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}},
              "required": ["n"]}
    jsonschema.validate(json.loads(text(guided_json=schema)), schema)
    compact = text(structured_outputs={"json": schema, "disable_any_whitespace": True})
    assert " " not in compact and "\n" not in compact
    chat = client.chat.completions.create(model=model, messages=[
        {"role": "user", "content": "JSON please"}], response_format={"type": "json_object"},
        max_tokens=200, temperature=0)
    assert isinstance(json.loads(chat.choices[0].message.content), dict)


def _check_calls(calls, allowed: set[str], tools: list[dict]) -> None:
    assert calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_required_and_named_tool_choice_always_give_valid_calls(served) -> None:
    base, model, _, tools = served
    client = _client(base)
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                  tools=tools, max_tokens=300,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    for seed in range(4):
        resp = client.chat.completions.create(tool_choice="required", temperature=1.0,
                                              seed=seed, **kwargs)
        # parallel calls may go on to the token limit
        assert resp.choices[0].finish_reason in ("tool_calls", "length")
        _check_calls(resp.choices[0].message.tool_calls, {"get_weather", "get_time"}, tools)
        named = client.chat.completions.create(
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            temperature=1.0, seed=seed, **kwargs)
        _check_calls(named.choices[0].message.tool_calls, {"get_time"}, tools)
        assert len(named.choices[0].message.tool_calls) == 1
        assert named.choices[0].finish_reason == "tool_calls"
        single = client.chat.completions.create(tool_choice="required", temperature=1.0,
                                                seed=seed, parallel_tool_calls=False, **kwargs)
        assert len(single.choices[0].message.tool_calls) == 1


def test_streamed_tool_calls_add_up_to_the_whole_response(served) -> None:
    base, model, _, tools = served
    client = _client(base)
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Time in Paris?"}],
                  tools=tools, tool_choice="required", temperature=0, max_tokens=300,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls]
    assert content == (whole.message.content or "") and finish == whole.finish_reason


SCRIPTED = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSt Ives\n"
            "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def test_auto_parses_the_call_the_model_emits(default_server) -> None:
    """The model's output is scripted by a one-choice constraint; tool_choice auto parses it,
    and tool_choice none leaves it as text."""
    base, model, _, _ = default_server
    client = _client(base)
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                  max_tokens=200, temperature=0, extra_body={"guided_choice": [SCRIPTED]})
    msg = client.chat.completions.create(tool_choice="auto", **kwargs).choices[0]
    assert msg.finish_reason == "tool_calls" and msg.message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in msg.message.tool_calls] == [("get_weather", {"city": "St Ives", "days": 3})]
    none = client.chat.completions.create(tool_choice="none", **kwargs).choices[0]
    assert none.message.content == SCRIPTED and not none.message.tool_calls
    assert none.finish_reason == "stop"


def test_tools_and_tool_turns_reach_the_template(served) -> None:
    base, model, _, _ = served
    if model == "stdlib-19m":
        pytest.skip("the default model's template renders no tools")
    client = _client(base)
    base_msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    plain = client.chat.completions.create(model=model, messages=base_msgs, max_tokens=1)
    with_tools = client.chat.completions.create(model=model, messages=base_msgs, tools=TOOLS,
                                                max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    turn = [*base_msgs, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Oslo", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"}]
    after = client.chat.completions.create(model=model, messages=turn, tools=TOOLS, max_tokens=1)
    assert after.usage.prompt_tokens > with_tools.usage.prompt_tokens + 10


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/v1/{path}", json=body, timeout=60)


def _ids(base: str, text: str) -> list[int]:
    return httpx.post(f"{base}/tokenize", json={"prompt": text}).json()["tokens"]


def test_penalties_and_token_controls(default_server) -> None:
    base, model, _, _ = default_server
    body = {"model": model, "prompt": "import os\nimport sys\n", "max_tokens": 32,
            "temperature": 0}
    greedy = _post(base, "completions", body).json()["choices"][0]["text"]
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                  {"repetition_penalty": 1.8}):
        changed = _post(base, "completions", {**body, **extra}).json()["choices"][0]["text"]
        assert changed != greedy, extra
    token = _ids(base, " banana")[0]
    forced = _post(base, "completions", {**body, "max_tokens": 4,
                                         "logit_bias": {str(token): 100}}).json()
    only = _post(base, "completions", {**body, "max_tokens": 4,
                                       "allowed_token_ids": [token]}).json()
    piece = httpx.post(f"{base}/detokenize", json={"tokens": [token]}).json()["prompt"]
    assert forced["choices"][0]["text"] == only["choices"][0]["text"] == piece * 4
    stop_at = _ids(base, greedy)[3]
    stopped = _post(base, "completions", {**body, "stop_token_ids": [stop_at]}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] <= 4 and greedy.startswith(
        stopped["choices"][0]["text"])
    line = {**body, "stop": ["\n"], "max_tokens": 40}
    short = _post(base, "completions", line).json()
    kept = _post(base, "completions", {**line, "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == short["choices"][0]["text"] + "\n"
    floor = _post(base, "completions", {**line, "min_tokens": 12}).json()
    assert floor["usage"]["completion_tokens"] >= 12 > short["usage"]["completion_tokens"]
    word = greedy.split()[0]
    banned = _post(base, "completions", {**body, "bad_words": [word]}).json()
    assert banned["choices"][0]["text"] != greedy
    assert _post(base, "completions", {**body, "skip_special_tokens": False,
                                       "user": "u1", "store": False}).status_code == 200


@pytest.mark.parametrize(("path", "extra", "needle"), [
    ("completions", {"frobnicate": 1}, "frobnicate: this field is not supported"),
    ("chat/completions", {"response_format": {"type": "bogus"}}, "response_format"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs needs logprobs"),
    ("chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"},
     "only one output constraint"),
    ("completions", {"structured_outputs": {"json": {"$ref": "#/nowhere"}}},
     "the json constraint cannot be compiled"),
    ("completions", {"guided_regex": "(unclosed"}, "the regex constraint cannot be compiled"),
    ("completions", {"guided_grammar": "root ::= missing"}, "grammar constraint cannot be"),
    ("completions", {"structured_outputs": {"bogus": 1}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"choice": []}}, "choice"),
    ("completions", {"logit_bias": {"99999999": 5}}, "outside the vocabulary"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"logit_bias": {"\u00b2": 1}}, "logit_bias"),
    ("completions", {"presence_penalty": 3}, "presence_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("completions", {"min_tokens": 50, "max_tokens": 5}, "min_tokens"),
    ("completions", {"best_of": 2}, "best_of"),
    ("chat/completions", {"tool_choice": "required"}, "needs tools"),
    ("chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function",
                                                          "function": {"name": "nope"}}},
     "not among the tools"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x"}}}, "needs a schema"),
    ("completions", {"allowed_token_ids": [0], "min_tokens": 1, "ignore_eos": False,
                     "stop_token_ids": [0]}, "no token is allowed"),
])
def test_fields_refused_with_a_400_naming_them(default_server, path, extra, needle) -> None:
    base, model, _, _ = default_server
    body = {"model": model, "max_tokens": 8, **extra}
    if path == "completions":
        body["prompt"] = "x = "
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    resp = _post(base, path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert needle in error["message"], error
    assert _post(base, "completions", {"model": model, "prompt": "x", "max_tokens": 2}
                 ).status_code == 200  # and the server keeps serving
