"""A request's output constraint from its fields: OpenAI's response_format, vLLM's
structured_outputs and guided_* names, and tool_choice required / named (server/tools.py). At
most one may be given; every name or value this server does not take is a 400."""

from __future__ import annotations

from deltaserve.errors import DeltaserveError
from deltaserve.server.errors import ApiError
from deltaserve.server.tools import ToolSpec, required_tag
from deltaserve.structured.params import StructuredOutputsParams

_KEYS = {"json", "regex", "choice", "grammar", "json_object", "structural_tag",
         "disable_any_whitespace"}


def tool_spec(body) -> ToolSpec | None:
    """The tools whose calls are parsed from the output (none with tool_choice "none")."""
    if not getattr(body, "tools", None) or body.tool_choice == "none":
        return None
    return ToolSpec({t.function.name: t.function.parameters or {"type": "object"}
                     for t in body.tools}, body.parallel_tool_calls)


def structured_of(body, spec: ToolSpec | None) -> StructuredOutputsParams | None:
    """The one constraint of a request (spec: its tool_spec, for tool_choice required / named)."""
    given: list[tuple[str, dict]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if not fmt.json_schema or "schema" not in fmt.json_schema:
            raise ApiError(400, "response_format.json_schema needs a schema",
                           param="response_format")
        given.append(("response_format", {"json": fmt.json_schema["schema"]}))
    if body.structured_outputs is not None:
        unknown = set(body.structured_outputs) - _KEYS
        if unknown:
            raise ApiError(400, f"structured_outputs: {sorted(unknown)} not supported (takes "
                           f"{sorted(_KEYS)})", param="structured_outputs")
        given.append(("structured_outputs", dict(body.structured_outputs)))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if getattr(body, name) is not None:
            given.append((name, {key: getattr(body, name)}))
    choice = getattr(body, "tool_choice", None)
    if spec is not None and choice not in (None, "auto"):
        only = None if choice == "required" else choice.function.name
        given.append(("tool_choice", {"structural_tag": required_tag(spec, only)}))
    if len(given) > 1:
        raise ApiError(400, "only one output constraint per request; got "
                       + ", ".join(name for name, _ in given), param=given[1][0])
    if not given:
        return None
    name, fields = given[0]
    try:
        return StructuredOutputsParams(**fields)
    except (DeltaserveError, TypeError, ValueError) as exc:
        raise ApiError(400, f"{name}: {exc}", param=name) from exc
