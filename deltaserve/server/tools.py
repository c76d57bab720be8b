"""Tool calls in Qwen3.5's format (the layout its chat template teaches):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

ToolCalls reads a choice's content as it streams: text outside calls passes through (text that
may start a call is held back), each complete call becomes an OpenAI tool call whose `arguments`
are JSON typed by the tool's schema; a call that does not parse (unknown function, a value that
does not fit its type, unclosed tags) goes out as the text it was, never an error. The blanks
around a parsed call are dropped. The constraint for tool_choice required / named
(required_tag) makes the model's output such calls.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from deltaserve.server.reasoning import TOOL_CALL, partial_tag

OPEN, CLOSE = TOOL_CALL, "</tool_call>"
_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>\s*(.*?)\s*</function>\s*$", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """The request's tools by name (their parameter schemas) and whether several calls may come
    in one turn."""

    schemas: dict[str, dict]
    parallel: bool = True


def parse_call(block: str, spec: ToolSpec) -> dict | None:
    """The inside of one <tool_call>...</tool_call> as {"name", "arguments"}, or None."""
    match = _FUNCTION.match(block)
    if match is None or match.group(1) not in spec.schemas:
        return None
    name, body = match.group(1), match.group(2)
    props = (spec.schemas[name] or {}).get("properties") or {}
    args: dict = {}
    pos = 0
    for param in _PARAMETER.finditer(body):
        if body[pos : param.start()].strip():  # text between parameters: not a call
            return None
        pos = param.end()
        key, raw = param.group(1), param.group(2)
        schema = props.get(key) or {}
        if not _free_string(schema):  # the grammar lets blanks surround such values
            raw = raw.strip()
        value = _typed(raw, schema)
        if value is _BAD:
            return None
        args[key] = value
    if body[pos:].strip():
        return None
    return {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}


_BAD = object()


def _typed(raw: str, schema: dict):
    """A parameter's text as the value its schema's type says (strings as written)."""
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if kinds == ["string"] or (not kinds and "enum" not in schema and "const" not in schema
                               and not _looks_json(raw)):
        return raw
    try:
        value = json.loads(raw)
    except ValueError:
        if raw.strip().lower() in ("true", "false") and "boolean" in kinds:
            return raw.strip().lower() == "true"
        return raw if "string" in kinds or not kinds else _BAD
    checks = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
              "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
              "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
              "string": lambda v: isinstance(v, str)}
    if kinds and not any(checks.get(k, lambda v: True)(value) for k in kinds):
        return raw if "string" in kinds else _BAD
    return value


def _free_string(schema: dict) -> bool:
    """A string parameter whose text is kept as written (the template's newlines aside)."""
    return schema.get("type") == "string" and "enum" not in schema and "const" not in schema


def _looks_json(raw: str) -> bool:
    text = raw.strip()
    return text[:1] in ("{", "[") or text in ("true", "false", "null") or \
        re.fullmatch(r"-?\d+(\.\d+)?([eE][-+]?\d+)?", text) is not None


class ToolCalls:
    """One choice's content split into text and tool calls as it streams."""

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.calls: list[dict] = []  # OpenAI tool calls, in order
        self._held = ""  # text not yet handed out: a possible call start, or trailing blanks
        self._in_call = False
        self._gap = ""  # the blanks before the open call: dropped if it parses
        self._out: list[str] = []
        self._emitted = False

    def push(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """(content to send now, new tool calls) for the next piece of content."""
        self._held += text
        self._out, new = [], []
        while True:
            if self._in_call:
                end = self._held.find(CLOSE)
                if end < 0:
                    break
                block, self._held = self._held[:end], self._held[end + len(CLOSE):]
                self._in_call = False
                call = parse_call(block, self.spec)
                if call is None:
                    self._emit(self._gap + OPEN + block + CLOSE)
                elif self.spec.parallel or not self.calls:  # else: one call per turn
                    new.append(self._add(call))
                self._gap = ""
                continue
            start = self._held.find(OPEN)
            if start < 0:
                break
            before = self._held[:start]
            body = before.rstrip()
            self._emit(body)
            self._gap = before[len(body):]
            self._held, self._in_call = self._held[start + len(OPEN):], True
        if final:
            if self._in_call:  # never closed: the text it was
                self._emit(self._gap + OPEN + self._held)
            else:
                self._emit(self._held.rstrip() if self.calls else self._held)
            self._held, self._in_call, self._gap = "", False, ""
        elif not self._in_call:  # keep what could still begin a call, and trailing blanks
            keep = partial_tag(self._held, OPEN)
            body = self._held[: len(self._held) - keep]
            cut = len(body.rstrip())
            self._emit(body[:cut])
            self._held = self._held[cut:]
        return "".join(self._out), new

    def _emit(self, text: str) -> None:
        if not self._emitted and self.calls:  # content that follows a call starts with text
            text = text.lstrip()
        if text:
            self._out.append(text)
            self._emitted = True

    def _add(self, call: dict) -> dict:
        item = {"index": len(self.calls), "id": f"call_{secrets.token_hex(12)}",
                "type": "function", "function": call}
        self.calls.append(item)
        return item


def required_tag(spec: ToolSpec, only: str | None = None) -> str:
    """xgrammar's structural tag for tool_choice "required" (one call or more; exactly one
    without parallel calls) or a named function: calls in the template's layout whose
    parameters follow each tool's schema."""
    names = [only] if only is not None else list(spec.schemas)
    tags = [{"type": "tag", "begin": f"{OPEN}\n<function={name}>\n",
             "content": {"type": "json_schema", "style": "qwen_xml",
                         "json_schema": spec.schemas[name] or {"type": "object"}},
             "end": f"</function>\n{CLOSE}"} for name in names]
    fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
           "stop_after_first": not spec.parallel or only is not None}
    return json.dumps({"type": "structural_tag", "format": fmt})
