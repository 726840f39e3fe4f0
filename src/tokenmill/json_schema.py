"""JSON schemas as constraints: objects without ``additionalProperties`` are closed, whitespace is bounded.
Torch-free.

JSON Schema lets an object that does not say ``additionalProperties`` carry any other key, and pydantic writes
no such key for a model (its nested models in ``$defs`` included). Under a grammar that is an invitation: the
135M model, forced to call a function whose argument was a pydantic model, wrote ``"description"`` keys inside
the nested price until ``max_tokens`` ran out. OpenAI's strict structured outputs require every object closed,
and vLLM's default xgrammar backend treats an unspecified ``additionalProperties`` as false; tokenmill closes
such objects too. A schema that wants extra keys says ``"additionalProperties": true`` (or gives a schema).

Whitespace between JSON tokens is bounded to a run of ``MAX_WHITESPACE`` characters (llguidance's
``whitespace_pattern``): left free, Qwen2.5-1.5B wrote ``"price":`` and then spaces until ``max_tokens``,
the grammar allowing each one. Pretty-printed JSON (a newline and an indent) still fits.
"""

from __future__ import annotations

from typing import Any

# keywords whose value is a schema / a list of schemas / a map of name -> schema
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalProperties")  # fmt: skip
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema that lists ``properties`` but says nothing of other
    keys (no ``additionalProperties``, no ``patternProperties``) has ``additionalProperties: false``."""
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
    # an object that names its keys; {"type": "object"} alone (json_object) means any object and stays open
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


MAX_WHITESPACE = 20
_WHITESPACE = {"whitespace_pattern": f"[\\n\\t ]{{0,{MAX_WHITESPACE}}}"}


def as_constraint(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` as tokenmill constrains output with it: objects closed (:func:`close_objects`) and runs of
    whitespace bounded, unless the schema sets llguidance's own options (``x-guidance``)."""
    out: dict[str, Any] = close_objects(schema)
    out.setdefault("x-guidance", _WHITESPACE)
    return out
