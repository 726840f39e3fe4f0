"""JSON schemas as constraints: objects without ``additionalProperties`` are closed. Torch-free.

JSON Schema lets an object that does not say ``additionalProperties`` carry any other key, and pydantic writes
no such key for a model (its nested models in ``$defs`` included). Under a grammar that is an invitation: the
135M model, forced to call a function whose argument was a pydantic model, wrote ``"description"`` keys inside
the nested price until ``max_tokens`` ran out. OpenAI's strict structured outputs require every object closed,
and vLLM's default xgrammar backend treats an unspecified ``additionalProperties`` as false; tokenmill closes
such objects too. A schema that wants extra keys says ``"additionalProperties": true`` (or gives a schema).
"""

from __future__ import annotations

from typing import Any

# keywords whose value is a schema / a list of schemas / a map of name -> schema
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalProperties")  # fmt: skip
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema without ``additionalProperties`` has it false."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"])
    if (is_object or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
