"""Hypothesis strategies from JSON Schema: the subset pydantic writes into an OpenAPI document
(``$ref``, ``anyOf``, ``const``/``enum``, typed scalars with bounds, arrays, objects with
required and optional properties). hypothesis-jsonschema would do this but no release works
with the pinned Hypothesis; this is small enough to own."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

MAX_ITEMS = 4  # arrays and free-form objects stay small: the fuzz test is about values, not size
MAX_TEXT = 40

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


def from_schema(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A strategy for values valid under ``schema``; ``$ref``s resolve against ``root``."""
    if "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        return st.deferred(lambda: from_schema(node, root))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, root) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        low, high = schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum")
        return st.floats(low, high, exclude_min="exclusiveMinimum" in schema, allow_nan=False,
                         allow_infinity=False)
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", MAX_TEXT), MAX_TEXT))
    if kind == "array":
        items = from_schema(schema["items"], root) if "items" in schema else JSON_VALUES
        low = schema.get("minItems", 0)
        return st.lists(items, min_size=low, max_size=max(low, min(schema.get("maxItems", MAX_ITEMS), MAX_ITEMS)))
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        if not props:
            values = JSON_VALUES if schema.get("additionalProperties") in (None, True) else from_schema(
                schema["additionalProperties"], root)
            return st.dictionaries(st.text(max_size=8), values, max_size=MAX_ITEMS)
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: from_schema(v, root) for k, v in props.items() if k in required},
            optional={k: from_schema(v, root) for k, v in props.items() if k not in required},
        )
    return JSON_VALUES  # no constraint (``Any``)
