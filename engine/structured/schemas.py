"""closed_objects: a JSON schema's objects with no keys the schema does not list, unless it allows
them (vLLM's default reading of a schema)."""
from __future__ import annotations

from collections.abc import Callable

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def rewrite(schema, visit: Callable[[dict, bool], dict], in_all_of: bool = False):
    """`schema` with `visit(node, in_all_of)` applied to each subschema, innermost first, on copies.
    in_all_of: the node is a member of an allOf."""
    if isinstance(schema, list):
        return [rewrite(s, visit, in_all_of) for s in schema]
    if not isinstance(schema, dict):
        return schema  # true / false schemas
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = rewrite(out[key], visit)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = rewrite(out[key], visit, in_all_of=key == "allOf")
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: rewrite(sub, visit) for name, sub in out[key].items()}
    return visit(out, in_all_of)


def closed_objects(schema):
    """`schema` with `"additionalProperties": false` in each object schema that says nothing of
    other keys, as vLLM's default backend (xgrammar, strict mode) reads a schema: a model is not to
    invent keys the schema does not list. Where a schema allows them it says so. allOf's members
    are left open (each sees only its own properties: closing them would refuse their union)."""
    def close(node: dict, in_all_of: bool) -> dict:
        kind = node.get("type")
        is_object = "properties" in node or kind == "object" or (isinstance(kind, list) and "object" in kind)
        if is_object and not in_all_of and "additionalProperties" not in node and "unevaluatedProperties" not in node:
            node["additionalProperties"] = False
        return node
    return rewrite(schema, close)
