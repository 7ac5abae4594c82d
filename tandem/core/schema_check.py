"""JSON-schema keywords the grammar does not enforce, refused before compiling.

xgrammar compiles some keywords to nothing: a schema using them compiles, and the
outputs then break it (``{"type": "integer", "not": {"type": "integer"}}`` gives
``0``). Each rule below was found by compiling a schema and feeding the grammar a
value that violates it (``tests/core/test_schema_check.py`` keeps those probes, so
an xgrammar that starts enforcing a keyword shows up as a failing probe). A
refusal names the keyword and its JSON pointer in the schema.

Annotations (``title``, ``description``, ``default``, ``examples``, ...) and
unknown keywords are left alone: JSON Schema ignores them too.
"""

from __future__ import annotations

# Validation keywords xgrammar 0.2 compiles to nothing.
UNENFORCED = {
    "not": "negation",
    "if": "conditional subschemas",
    "then": "conditional subschemas",
    "else": "conditional subschemas",
    "dependentRequired": "conditional requirements",
    "dependentSchemas": "conditional subschemas",
    "dependencies": "conditional requirements",
    "contains": "array membership",
    "minContains": "array membership",
    "maxContains": "array membership",
    "$dynamicRef": "dynamic references",
    "$recursiveRef": "dynamic references",
}
# String formats the grammar checks; any other is refused (xgrammar ignores it).
ENFORCED_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})
# Keywords that constrain one JSON type; xgrammar applies them only where "type" says so.
TYPED = {
    "minimum": "number", "maximum": "number", "exclusiveMinimum": "number", "exclusiveMaximum": "number",
    "multipleOf": "number", "minLength": "string", "maxLength": "string", "pattern": "string",
    "format": "string", "minItems": "array", "maxItems": "array", "items": "array", "prefixItems": "array",
}
# Keywords that say nothing about validity.
ANNOTATIONS = frozenset({
    "$schema", "$id", "$anchor", "$comment", "$defs", "definitions", "title", "description", "default",
    "examples", "deprecated", "readOnly", "writeOnly", "contentEncoding", "contentMediaType", "$vocabulary",
})
_COMBINATORS = ("anyOf", "oneOf", "allOf", "$ref")
_JSON_TYPES = {"null": (type(None),), "boolean": (bool,), "object": (dict,), "array": (list,), "string": (str,)}


class UnenforcedSchemaError(ValueError):
    """A schema keyword the grammar would not enforce."""


def check_enforceable(schema: object) -> None:
    """Raise ``UnenforcedSchemaError`` naming the first keyword (and where it is) that
    the compiled grammar would not enforce. Walks iteratively: depth is bounded by the
    caller's parse, not by Python's stack."""
    stack: list[tuple[object, str]] = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        _check_node(node, path)
        for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            sub = node.get(key)
            if isinstance(sub, dict):
                stack.extend((v, f"{path}/{key}/{_escape(k)}") for k, v in sub.items())
        for key in ("additionalProperties", "items", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
                    "not", "if", "then", "else", "contains"):
            if isinstance(node.get(key), dict):
                stack.append((node[key], f"{path}/{key}"))
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            if isinstance(node.get(key), list):
                stack.extend((v, f"{path}/{key}/{i}") for i, v in enumerate(node[key]))


def _check_node(node: dict, path: str) -> None:
    ref = node.get("$ref")
    if "$ref" in node and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        # xgrammar drops a reference it cannot resolve in the schema itself (the value is
        # then unconstrained); nothing is ever fetched, so another document is refused.
        _refuse(path, "$ref", f"{_cut(ref)!r} is not a reference inside this schema: only '#' and '#/...' "
                              "references are resolved (nothing is fetched: put the referenced schema in $defs)")
    for key, what in UNENFORCED.items():
        if key in node:
            _refuse(path, key, f"the grammar does not enforce {what}")
    if node.get("uniqueItems") is True:
        _refuse(path, "uniqueItems", "the grammar does not enforce unique array items")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        _refuse(path, "allOf", f"the grammar does not merge {len(node['allOf'])} schemas (allOf with one schema is "
                               "taken)")
    one_of = node.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1 and not _disjoint(one_of):
        _refuse(path, "oneOf", "the grammar enforces one branch matching, not exactly one: give branches of "
                               "distinct types or a required property with a distinct const in each, or use anyOf")
    types = _types(node)
    for key, json_type in TYPED.items():
        if key in node and (types is None or not _covers(types, json_type)):
            _refuse(path, key, f"applies to {json_type}s, and the grammar enforces it only beside "
                               f'"type": "{json_type}"' + ("" if json_type != "number" else ' or "integer"'))
    if "format" in node and node["format"] not in ENFORCED_FORMATS:
        _refuse(path, "format", f"the grammar does not check format {node['format']!r} (it checks "
                                f"{', '.join(sorted(ENFORCED_FORMATS))})")
    if "multipleOf" in node and not (types == {"integer"} and _is_int(node["multipleOf"])):
        _refuse(path, "multipleOf", 'the grammar enforces only a whole multipleOf with "type": "integer"')
    beside = "format" if "format" in node else "pattern" if "pattern" in node else None
    for key in ("pattern", "minLength", "maxLength"):
        if beside is not None and key != beside and key in node:
            _refuse(path, key, f"the grammar drops it beside {beside}: fold it into a pattern")
    required = node.get("required")
    if isinstance(required, list):
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        for i, name in enumerate(required):
            if name not in props:
                _refuse(f"{path}/required/{i}", "required", f"{name!r} is not in properties, and the grammar "
                                                            "enforces only required properties it lists")
    for combinator in _COMBINATORS:
        if combinator in node:
            siblings = sorted(k for k in node if k not in ANNOTATIONS and k not in _COMBINATORS)
            if siblings:
                _refuse(path, siblings[0], f"the grammar ignores it beside {combinator}: move it into the "
                                           f"{'referenced schema' if combinator == '$ref' else 'branches'}")
    for key in ("enum", "const"):
        if key in node:
            _check_values(node, path, key)


def _check_values(node: dict, path: str, key: str) -> None:
    """The grammar writes enum / const values as given, ignoring every sibling but
    "type": a value must satisfy the type, and no other constraint may stand beside."""
    others = sorted(k for k in node if k not in ANNOTATIONS and k not in ("enum", "const", "type"))
    if others:
        _refuse(path, others[0], f"the grammar ignores it beside {key}: list only values that satisfy it")
    types = _types(node)
    values = node[key] if key == "enum" and isinstance(node[key], list) else [node[key]]
    for i, value in enumerate(values):
        if types is not None and not any(_is_type(value, t) for t in types):
            where = f"{path}/enum/{i}" if key == "enum" else f"{path}/const"
            _refuse(where, key, f"{value!r} is not of type {' or '.join(sorted(types))}")


def _types(node: dict) -> set[str] | None:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return set(t)
    return None


def _covers(types: set[str], json_type: str) -> bool:
    return json_type in types or (json_type == "number" and "integer" in types)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) or isinstance(x, float) and x.is_integer()


def _is_type(value, json_type: str) -> bool:
    if json_type == "integer":
        return _is_int(value)
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _JSON_TYPES.get(json_type, ()))


def _disjoint(branches: list) -> bool:
    """Whether no value can match two branches: each branch has one distinct type
    (integer and number overlap), or each requires a shared property to a distinct
    const."""
    if not all(isinstance(b, dict) for b in branches):
        return False
    types = [_types(b) for b in branches]
    if all(t is not None and len(t) == 1 for t in types):
        flat = ["number" if next(iter(t)) == "integer" else next(iter(t)) for t in types]
        if len(set(flat)) == len(flat):
            return True
    common = set.intersection(*(set(b.get("required") or ()) for b in branches))
    for name in sorted(common):
        consts = []
        for b in branches:
            prop = (b.get("properties") or {}).get(name)
            if not isinstance(prop, dict) or "const" not in prop:
                break
            consts.append(repr(prop["const"]))
        else:
            if len(set(consts)) == len(consts):
                return True
    return False


def _cut(value: object, n: int = 80) -> object:
    return value if not isinstance(value, str) or len(value) <= n else value[: n - 3] + "..."


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _refuse(path: str, keyword: str, why: str):
    raise UnenforcedSchemaError(f"keyword {keyword!r} at {path}: {why}")
