"""Varied JSON schemas (nested objects, arrays, enums, bounded integers, optional fields, string
patterns) for the structured-output tests."""

S = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": S}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
     "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"]}},
        "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
     "required": ["zip"]},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
     "required": ["x", "y"]},
    {"type": "object", "properties": {"id": {"type": "integer"}, "note": S},
     "required": ["id"]},  # an optional field
    {"type": "object", "properties": {"kind": {"const": "point"}, "v": {"type": "integer"}},
     "required": ["kind", "v"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
     "required": ["value"]},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"p": {"type": "array", "items": {
        "type": "object", "properties": {"q": {"type": "boolean"}}, "required": ["q"]},
        "maxItems": 2}}, "required": ["p"]},
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 0,
                                            "maximum": 9}}, "required": ["n"]},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}}, "required": ["level"]},
    {"type": "object", "properties": {"first": S, "last": S, "age": {
        "type": "integer", "minimum": 18, "maximum": 99}},
     "required": ["first", "last", "age"]},
    {"type": "boolean"},
    {"type": "integer", "minimum": 100, "maximum": 999},
    {"type": "object", "properties": {"m": {"type": "object", "properties": {
        "k": {"enum": ["x", "y"]}, "w": {"type": "array", "items": {"type": "number"},
                                         "maxItems": 2}}, "required": ["k", "w"]}},
     "required": ["m"]},
    {"type": "object", "properties": {"email": {"type": "string",
                                                "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"}},
     "required": ["email"]},
]


def finite(schema: dict) -> bool:
    """Whether every value the schema allows has a bounded length (bounded integers, strings with
    a maxLength or a bounded pattern, arrays with maxItems): a model with random weights may
    otherwise write digits or characters until its token limit."""
    if "enum" in schema or "const" in schema or schema.get("type") in ("boolean", "null"):
        return True
    if "anyOf" in schema:
        return all(finite(s) for s in schema["anyOf"])
    kind = schema.get("type")
    if kind == "integer":
        low = "minimum" in schema or "exclusiveMinimum" in schema
        return low and ("maximum" in schema or "exclusiveMaximum" in schema)
    if kind == "string":
        pattern = schema.get("pattern", "")
        return "maxLength" in schema or (pattern != "" and not any(c in pattern for c in "*+"))
    if kind == "array":
        return "maxItems" in schema and finite(schema.get("items", {}))
    if kind == "object":
        return all(finite(s) for s in schema.get("properties", {}).values())
    return False
