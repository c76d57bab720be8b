"""StructuredOutputsParams: vLLM's names for the one constraint a request may carry."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from deltaserve.errors import RequestError


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Exactly one of: json (a JSON schema, as a dict or its text), regex, choice (the output is
    one of these strings), grammar (EBNF / GBNF), json_object (any JSON object), structural_tag
    (xgrammar's structural-tag JSON; tool calls use it). disable_any_whitespace: JSON without
    free whitespace between tokens (compact, as the schema's separators)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise RequestError("choice takes a non-empty list of non-empty strings")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except ValueError as exc:
                raise RequestError(f"the JSON schema is not valid JSON: {exc}") from None
        if self.json is not None and not isinstance(self.json, dict | bool):
            raise RequestError("a JSON schema must be an object")
        kinds = [f.name for f in fields(self) if f.name != "disable_any_whitespace"
                 and getattr(self, f.name) not in (None, False)]
        if len(kinds) != 1:
            raise RequestError("structured outputs take exactly one of json, regex, choice, "
                               f"grammar, json_object, structural_tag; got {kinds or 'none'}")

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if f.name != "disable_any_whitespace"
                    and getattr(self, f.name) not in (None, False))

    def key(self) -> tuple:
        """What identifies the compiled grammar (the compile cache's key)."""
        value = getattr(self, self.kind)
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        return self.kind, value, self.disable_any_whitespace
