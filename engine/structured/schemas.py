"""A JSON schema as vLLM's default backend (xgrammar, strict mode) reads it, for llguidance:
closed_objects, its objects with no keys the schema does not list, unless it allows them; and
enforceable, its formats and bounds as the grammar can hold them.

xgrammar's strict mode amounts to `unevaluatedProperties: false`, which sees the keys a composition
lists (allOf, anyOf, oneOf, $ref, if/then/else). llguidance has no unevaluatedProperties, and an
`additionalProperties: false` sees only its own node's properties, so only objects that list all
their keys themselves are closed: none that composes others or is a member of a composition (nor
a $defs entry such a place refers to). A composed schema keeps JSON Schema's open default, as it
had before. Data that looks like a schema (`const`, `enum`, `default`, `examples`) is never read.
"""
from __future__ import annotations

import math

COMPOSING = ("allOf", "anyOf", "oneOf", "$ref", "$dynamicRef", "if", "then", "else", "not", "dependentSchemas",
             "dependencies", "unevaluatedProperties")
ANNOTATIONS = ("title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly", "$comment")
_SCHEMA = ("items", "additionalItems", "contains", "unevaluatedItems", "additionalProperties", "propertyNames")
_SCHEMA_MAPS = ("properties", "patternProperties")
_DEFS = ("$defs", "definitions")
_IDENTIFIERS = ("$schema", "$id", "$anchor")

# The string formats llguidance enforces; any other is an annotation (JSON Schema's default), as
# vLLM's xgrammar reads it, so pydantic's (uuid4, password, binary, path, ...) do not refuse a schema
FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"})
_UUID_VERSION = {f"uuid{v}": v for v in range(1, 9)}  # pydantic's UUID1..UUID8: that version's digit
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def enforceable(schema):
    """`schema` (a copy) as the grammar can enforce it: a `format` llguidance lacks is dropped (a
    uuidN one becomes that version's `pattern`); ValueError for an integer bound beyond 64 bits,
    which llguidance would saturate (its output would then break the schema, silently), and
    bounds past 2**53 rewritten as _held_bounds says. Walked by keyword, as closed_objects walks:
    a property named `default` is a schema, a `default` data."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in (*_SCHEMA, "if", "then", "else", "not"):
        if isinstance(out.get(key), dict):
            out[key] = enforceable(out[key])
    for key in ("prefixItems", "items", "allOf", "anyOf", "oneOf"):
        if isinstance(out.get(key), list):
            out[key] = [enforceable(s) for s in out[key]]
    for key in (*_SCHEMA_MAPS, *_DEFS, "dependentSchemas"):
        if isinstance(out.get(key), dict):
            out[key] = {name: enforceable(s) for name, s in out[key].items()}
    fmt = out.get("format")
    if isinstance(fmt, str) and fmt not in FORMATS:
        del out["format"]
        if fmt in _UUID_VERSION and "pattern" not in out:
            out["pattern"] = (f"^[0-9a-fA-F]{{8}}-[0-9a-fA-F]{{4}}-{_UUID_VERSION[fmt]}[0-9a-fA-F]{{3}}-"
                              "[89abAB][0-9a-fA-F]{3}-[0-9a-fA-F]{12}$")
    kind = out.get("type")
    if kind is None or kind == "integer" or (isinstance(kind, list) and "integer" in kind):  # or a composition's
        for key in _BOUNDS:
            value = out.get(key)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if not -2 ** 63 <= value < 2 ** 63:
                raise ValueError(f"{key} {value} is beyond what constrained decoding enforces for an integer "
                                 "(64 bits: -2**63 <= bound < 2**63)")
        if kind == "integer" or (isinstance(kind, list) and "number" not in kind):  # integers alone
            given = {k: out[k] for k in _BOUNDS if k in out}
            rewrote = _held_bounds(out, low=True) | _held_bounds(out, low=False)  # both, whatever the first says
            low, high = out.get("minimum"), out.get("maximum")
            if rewrote and isinstance(low, int) and isinstance(high, int) and low > high:
                bounds = ", ".join(f"{k} {v}" for k, v in given.items())
                raise ValueError(f"no integer within {bounds} can be enforced: past 2**53 constrained decoding "
                                 "reads bounds as float64 numbers, which hold only some integers there")
    return out


def _held_bounds(schema: dict, low: bool) -> bool:
    """An integer's lower (`low`) or upper bounds, where one is past 2**53, as one inclusive bound
    that a float64 holds: llguidance reads bounds as float64s, which there hold only some integers,
    and its exclusive bounds there act as inclusive ones. Rounded inward: a few values at the edge
    lost, never one past it let in. -> whether it rewrote them."""
    keys = ("minimum", "exclusiveMinimum") if low else ("maximum", "exclusiveMaximum")
    given = {k: schema[k] for k in keys if isinstance(schema.get(k), (int, float)) and not isinstance(schema[k], bool)}
    if not any(abs(v) >= 2 ** 53 for v in given.values()):
        return False
    if low:
        bound = max(math.ceil(v) if k == "minimum" else math.floor(v) + 1 for k, v in given.items())
    else:
        bound = min(math.floor(v) if k == "maximum" else math.ceil(v) - 1 for k, v in given.items())
    for k in keys:
        schema.pop(k, None)
    schema[keys[0]] = _inward(bound, up=low)
    return True


def _inward(bound: int, up: bool) -> int:
    """The nearest integer a float64 holds, above `bound` (`up`) or below it."""
    near = float(bound)
    if (near < bound) if up else (near > bound):
        near = math.nextafter(near, math.inf if up else -math.inf)
    return int(near)


def closed_objects(schema):
    """`schema` (a copy) with `"additionalProperties": false` in each object schema that lists its
    keys (`properties`) itself and says nothing of others."""
    kept_open: set[str] = set()
    _walk(schema, True, kept_open, close=False)  # first the $defs entries that must stay open
    return _walk(schema, True, kept_open, close=True)


def _is_object(node: dict) -> bool:
    kind = node.get("type")
    return "properties" in node or kind == "object" or (isinstance(kind, list) and "object" in kind)


def _walk(node, may_close: bool, kept_open: set[str], close: bool, path: str = "#"):
    """`node` rewritten (with `close`), its $refs from places that stay open collected in kept_open."""
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and (not may_close or set(node) - {"$ref", *ANNOTATIONS, *_DEFS, *_IDENTIFIERS}):
        # a member of a composition, or a $ref beside keys of its own (the definitions beside it
        # add none: pydantic's schema of a recursive model is {"$defs": ..., "$ref": ...})
        kept_open.add(ref)
    out = dict(node)
    composing = any(k in node for k in COMPOSING)
    for key in _SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _walk(out[key], True, kept_open, close, f"{path}/{key}")
    for key in ("prefixItems", "items"):
        if isinstance(out.get(key), list):
            out[key] = [_walk(s, True, kept_open, close, f"{path}/{key}/{i}") for i, s in enumerate(out[key])]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _walk(s, True, kept_open, close, f"{path}/{key}/{k}") for k, s in out[key].items()}
    for key in _DEFS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _walk(s, f"{path}/{key}/{k}" not in kept_open, kept_open, close, f"{path}/{key}/{k}")
                        for k, s in out[key].items()}
    members_close = not _is_object(node)  # anyOf/oneOf of whole objects (Optional[Model]); not a parent's parts
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(out.get(key), list):
            out[key] = [_walk(s, members_close and key != "allOf", kept_open, close, f"{path}/{key}/{i}")
                        for i, s in enumerate(out[key])]
    for key in ("then", "else"):
        if isinstance(out.get(key), dict):
            out[key] = _walk(out[key], False, kept_open, close, f"{path}/{key}")
    if isinstance(out.get("dependentSchemas"), dict):
        out["dependentSchemas"] = {k: _walk(s, False, kept_open, close, f"{path}/dependentSchemas/{k}")
                                   for k, s in out["dependentSchemas"].items()}
    for key in ("if", "not"):  # a condition, a negation: closing inside would change what they match
        _collect_refs(out.get(key), kept_open)
    # An object that lists no properties is a free-form map by intent ({"type": "object"}): left open.
    if close and may_close and not composing and "properties" in node and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out


def _collect_refs(node, kept_open: set[str]) -> None:
    """Every $ref under `node` stays open (its subtree is left as it is)."""
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            kept_open.add(node["$ref"])
        for key, value in node.items():
            if key not in ("const", "enum", "default", "examples"):
                _collect_refs(value, kept_open)
    elif isinstance(node, list):
        for value in node:
            _collect_refs(value, kept_open)
