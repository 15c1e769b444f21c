"""slotinfer's JSON-number policy: every number a schema lets a model write ends.

An ``integer`` or ``number`` with no bound lets a model write digits until ``max_tokens`` (a greedy
small model does: ``"population": 1200000000000...``), and RFC 8259 calls numbers beyond IEEE
double precision not interoperable.  So, where the schema sets no rule of its own:

- an ``integer`` lies within +-2^53 (the integers a double holds exactly);
- a ``number`` lies within +-2^53 with at most ``DECIMALS`` digits after the point (llguidance's
  bounded numbers take no exponent).

A schema's own ``minimum``/``maximum`` (or exclusive ones), ``multipleOf`` or ``pattern`` rules
instead: each bound missing is filled in alone.  The schema is rewritten before compiling; the
caller's dict is never changed.
"""

from __future__ import annotations

import json

LIMIT = 2**53
DECIMALS = 10  # llguidance 1.9 takes multipleOf down to 1e-10
_STEP = float(f"1e-{DECIMALS}")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def bounded_text(text: str) -> str:
    """``bounded`` for a schema's JSON text (request.check's normal form)."""
    return json.dumps(bounded(json.loads(text)))


def bounded(schema):
    """A copy of ``schema`` with the policy's bounds wherever it sets none."""
    if isinstance(schema, list):  # "items": [...] in older drafts
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = bounded(out[key])
    for key in _LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded(s) for s in out[key]]
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: bounded(s) for k, s in out[key].items()}
    types = out.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if "pattern" in out or not types & {"integer", "number"}:
        return out
    if "minimum" not in out and "exclusiveMinimum" not in out:
        out["minimum"] = -LIMIT
    if "maximum" not in out and "exclusiveMaximum" not in out:
        out["maximum"] = LIMIT
    if "number" in types and "multipleOf" not in out:
        out["multipleOf"] = _STEP
    return out
