"""Refuse JSON schemas whose keywords the grammar backend compiles but does not enforce.

xgrammar turns a schema into a context-free grammar and, for keywords a grammar cannot express (uniqueness,
counting, negation, conditionals, arithmetic on numbers), drops them with at most a log line: such a schema
compiles, and rows finish with ``stop`` and output the schema rejects. A row whose schema uses one is refused
instead, naming the keyword and where it sits (sglang PR #28804 does the same). The list below is what
xgrammar 0.2.9 leaves unenforced, each entry checked against ``jsonschema`` by
``tests/unit/test_json_schema_support.py``: keywords it drops wherever they are, keywords beside ``$ref``,
``anyOf``/``oneOf``/``allOf``, ``enum`` or ``const`` (which it takes alone), ``required`` names that are not
``properties``, ``minProperties`` where keys beyond ``properties`` may repeat, a ``$ref`` that is no pointer into
the schema, a ``pattern`` beside a ``format``, and a ``pattern`` anchor or lookahead it ignores (as a ``regex``
row's would be).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from batchgen.errors import FieldError
from batchgen.sampling.regex_support import check_json_string_pattern, check_regex

# Dropped wherever they appear (uniqueItems only when true: false asks nothing).
_DROPPED = {
    "uniqueItems": "array items cannot be kept unique",
    "contains": "array contents cannot be counted",
    "minContains": "array contents cannot be counted",
    "maxContains": "array contents cannot be counted",
    "not": "a negation is not enforced",
    "if": "conditionals are not enforced",
    "then": "conditionals are not enforced",
    "else": "conditionals are not enforced",
    "dependentRequired": "dependencies between properties are not enforced",
    "dependentSchemas": "dependencies between properties are not enforced",
    "dependencies": "dependencies between properties are not enforced",
    "$dynamicRef": "dynamic references are not followed",
    "$recursiveRef": "dynamic references are not followed",
}
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# JSON Schema's keywords that constrain a value (2020-12's validation and applicator vocabularies, and the older
# drafts' dependencies and additionalItems): beside $ref, a combinator, enum or const, xgrammar drops them. Any other
# key (title, description, $defs, format, OpenAPI's discriminator...) constrains nothing in jsonschema either.
_VALIDATING = frozenset(
    ("type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum")
    + ("maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "maxContains", "minContains")
    + ("maxProperties", "minProperties", "required", "dependentRequired", "dependencies", "allOf", "anyOf", "oneOf")
    + ("not", "if", "then", "else", "dependentSchemas", "prefixItems", "items", "additionalItems", "contains")
    + ("properties", "patternProperties", "additionalProperties", "propertyNames", "unevaluatedItems")
    + ("unevaluatedProperties", "$ref")
)
# xgrammar takes these alone and drops the keywords beside them (JSON Schema 2020-12 applies those too).
_TAKEN_ALONE = {
    "$ref": "move it into the schema $ref names",
    "anyOf": "move it into each branch",
    "oneOf": "move it into each branch",
    "allOf": "move it into the subschema",
}
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "object": (dict,),
    "array": (list,),
    "boolean": (bool,),
    "null": (type(None),),
    "number": (int, float),
    "integer": (int,),
}
# Where a schema holds subschemas: one, a name → subschema map, or a list (``items`` may be any of them).
_ONE = (
    *("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems"),
    *("contains", "propertyNames", "not", "if", "then", "else"),
)
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def check_enforceable(schema: Any) -> None:
    """Refuse a JSON schema (parsed) that uses a keyword xgrammar does not enforce, at any depth.

    Only subschema positions are searched, so the same names inside ``const``, ``enum``, ``default`` or
    ``examples`` values are data, not keywords. Every subschema of ``$defs``/``definitions`` is checked, used or
    not.

    Raises:
        FieldError: (``json_schema``) naming the first such keyword and its JSON pointer (``#`` is the root), or an
            empty ``anyOf``, ``oneOf``, ``type`` or ``enum`` list (which no value matches).
    """
    nodes = list(_subschemas(schema, "#"))
    nested_id = next((pointer for pointer, node in nodes[1:] if "$id" in node), None)
    if nested_id is not None and any("$ref" in node for _, node in nodes):
        # Its $ref pointers resolve against that subschema; xgrammar resolves every one against the root.
        raise FieldError("json_schema", f"$id at {nested_id} is not followed by xgrammar beside a $ref: remove it")
    for pointer, node in nodes:
        empty = next((key for key in ("anyOf", "oneOf", "type", "enum") if node.get(key) == []), None)
        if empty is not None:  # found by a helper: an empty anyOf gave "" (no JSON at all), an empty type numbers
            raise FieldError(
                "json_schema", f"{empty} at {pointer} is an empty list, which no value matches (refused wherever it is)"
            )
        problem = _unenforced(node, schema)
        if problem is not None:
            keyword, why = problem
            raise FieldError("json_schema", f"{keyword} at {pointer} is not enforced by xgrammar ({why})")


def _unenforced(node: dict[str, Any], root: Any) -> tuple[str, str] | None:
    """(keyword, why) of the first keyword of this one schema node that xgrammar would drop, or ``None``."""
    for keyword, why in _DROPPED.items():
        if keyword in node and (keyword != "uniqueItems" or node[keyword] is not False):
            return keyword, why
    if "multipleOf" in node:
        step = node["multipleOf"]
        if node.get("type") != "integer" or isinstance(step, bool) or not isinstance(step, int):
            return "multipleOf", "only an integer multipleOf of an integer-typed value is enforced"
        bound = next((b for b in _BOUNDS if b in node), None)
        if bound is not None:
            return "multipleOf", f"not enforced together with {bound}"
    for length in ("minLength", "maxLength"):
        shape = next((k for k in ("pattern", "format") if k in node), None)
        if length in node and shape is not None:
            return length, f"not enforced together with {shape}"
    if "pattern" in node and "format" in node:  # a format xgrammar knows replaces the pattern (email, date...)
        return "pattern", "not enforced together with format: drop one"
    ref = node.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        # An anchor (#name), a URL or a relative one: xgrammar lets any JSON value stand for it.
        return "$ref", f"{ref!r} is not followed (only pointers into this schema, '#/...', are)"
    for pointer, pattern in _node_patterns(node, ""):
        try:
            check_regex(pattern)
            check_json_string_pattern(pattern)
        except FieldError as e:  # xgrammar drops an anchor or a lookaround inside a pattern
            keyword = pointer.split("/")[1]  # pattern or patternProperties
            return keyword, f"{pattern!r}: {e.message.replace(' is not enforced by xgrammar', ' is dropped')}"
    all_of, one_of = node.get("allOf"), node.get("oneOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return "allOf", "several subschemas are not all enforced: merge them into one"
    if isinstance(one_of, list) and len(one_of) > 1 and not _disjoint(one_of, root):
        return "oneOf", "xgrammar may let several branches match: use anyOf if they cannot overlap"
    return _beside_taken_alone(node, root) or _object_problem(node)


def _beside_taken_alone(node: dict[str, Any], root: Any) -> tuple[str, str] | None:
    """A keyword xgrammar drops because it sits beside ``$ref``, a combinator, ``enum`` or ``const`` (``root``: the
    whole schema, whose ``$schema`` and definitions say when one is dropped with no loss)."""
    # Drafts 4 to 7 ignore $ref's siblings themselves, as xgrammar does.
    legacy = isinstance(root, dict) and any(f"draft-0{v}" in str(root.get("$schema", "")) for v in (4, 6, 7))
    for alone, move in _TAKEN_ALONE.items():
        if alone not in node or (alone == "$ref" and legacy):
            continue
        others = [k for k in node if k != alone and k in _VALIDATING]
        if others == ["type"] and alone != "$ref" and _branches_of_type(node[alone], node["type"], root):
            continue  # every branch already holds only values of the type
        if others:
            return others[0], f"a keyword beside {alone} is not enforced: {move}"
    for alone in ("enum", "const"):
        if alone in node:
            other = next((k for k in node if k not in (alone, "type") and k in _VALIDATING), None)
            if other is not None:
                return other, f"beside {alone} only its values are enforced"
            values = node[alone] if alone == "enum" and isinstance(node[alone], list) else [node[alone]]
            if "type" in node and not all(_of_type(value, node["type"]) for value in values):
                return "type", f"beside {alone} only its values are enforced: list only values of the type"
    return None


def _branches_of_type(branches: Any, json_type: Any, root: Any) -> bool:
    """Whether each of ``branches`` (a local ``$ref`` followed) declares a ``type`` among ``json_type``'s."""
    allowed = set(json_type if isinstance(json_type, list) else [json_type])
    if "number" in allowed:
        allowed.add("integer")
    for branch in branches if isinstance(branches, list) else []:
        branch = _resolved(branch, root)
        declared = branch.get("type") if isinstance(branch, dict) else None
        names = declared if isinstance(declared, list) else [declared]
        if declared is None or not set(names) <= allowed:
            return False
    return True


def _object_problem(node: dict[str, Any]) -> tuple[str, str] | None:
    """``required`` names xgrammar never writes, or a least count of keys it may meet by repeating one."""
    required, properties = node.get("required"), node.get("properties")
    listed = properties if isinstance(properties, dict) else {}
    missing = next((name for name in required if name not in listed), None) if isinstance(required, list) else None
    if missing is not None:
        return "required", f"'{missing}' is not among properties, and only those are written"
    least, extra = node.get("minProperties"), node.get("additionalProperties") not in (None, False)
    open_keys = extra or "patternProperties" in node or "propertyNames" in node
    # One key repeated still makes one: only a least count of 2 or more can be met by repeating one.
    if isinstance(least, int) and least >= 2 and open_keys:
        return "minProperties", "keys beyond properties may repeat, and a repeated key counts again"
    return None


def _of_type(value: Any, json_type: Any) -> bool:
    """Whether ``value`` (parsed JSON) is of the JSON Schema ``type`` (a name or a list of names; an integer is a
    number, and so is a float with no fraction an integer)."""
    names = json_type if isinstance(json_type, list) else [json_type]
    for name in names:
        if name == "integer" and isinstance(value, float) and value.is_integer():
            return True
        kinds = _JSON_TYPES.get(name, ()) if isinstance(name, str) else ()
        if isinstance(value, kinds) and not (isinstance(value, bool) and name in ("number", "integer")):
            return True
    return False


def _disjoint(branches: list[Any], root: Any) -> bool:
    """True when no two branches (local ``$ref`` followed) can hold the same value, so that ``oneOf`` means
    ``anyOf``, which xgrammar enforces: each has one ``type`` and no two share it (an integer is also a number), or
    each is an object requiring one property, the same in all, whose ``const`` is its own (pydantic's discriminated
    unions)."""
    resolved = [_resolved(branch, root) for branch in branches]
    types = [b.get("type") if isinstance(b, dict) else None for b in resolved]
    one_each = all(isinstance(t, str) for t in types) and len(set(types)) == len(types)
    if one_each and not {"integer", "number"} <= set(types):
        return True
    tags: list[dict[str, str]] = []  # per branch: required property → its const, as JSON text
    for b in resolved:
        properties = b.get("properties") if isinstance(b, dict) else None
        if not isinstance(properties, dict) or not isinstance(b.get("required"), list):
            return False
        consts = {n: p["const"] for n, p in properties.items() if isinstance(p, dict) and "const" in p}
        tags.append({n: json.dumps(v, sort_keys=True) for n, v in consts.items() if n in b["required"]})
    common = set.intersection(*(set(t) for t in tags))
    return any(len({t[name] for t in tags}) == len(tags) for name in common)


def _resolved(node: Any, root: Any) -> Any:
    """``node``, or the schema its local ``$ref`` (a JSON pointer into ``root``, RFC 6901) names (``None`` if none)."""
    ref = node.get("$ref") if isinstance(node, dict) else None
    if not (isinstance(ref, str) and ref.startswith("#/")):
        return node
    target = root
    for part in ref[2:].split("/"):
        target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
    return target


def schema_patterns(schema: Any) -> Iterator[tuple[str, str]]:
    """Every regex of a JSON schema (parsed), with its JSON pointer: each ``pattern`` and each key of a
    ``patternProperties``, in the subschema positions :func:`check_enforceable` searches."""
    for pointer, node in _subschemas(schema, "#"):
        yield from _node_patterns(node, pointer)


def _node_patterns(node: dict[str, Any], pointer: str) -> Iterator[tuple[str, str]]:
    """The regexes of one schema node at ``pointer``, with their pointers."""
    if isinstance(node.get("pattern"), str):
        yield f"{pointer}/pattern", node["pattern"]
    if isinstance(node.get("patternProperties"), dict):
        for key in node["patternProperties"]:
            yield f"{pointer}/patternProperties/{_escape(key)}", key


def _subschemas(node: Any, pointer: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object in ``node``, itself first, with its JSON pointer (boolean schemas have no keywords)."""
    if not isinstance(node, dict):
        return
    yield pointer, node
    for key in _ONE:
        if isinstance(node.get(key), dict):
            yield from _subschemas(node[key], f"{pointer}/{_escape(key)}")
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield from _subschemas(sub, f"{pointer}/{_escape(key)}/{_escape(str(name))}")
    for key in _LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield from _subschemas(sub, f"{pointer}/{_escape(key)}/{i}")


def _escape(token: str) -> str:
    """A JSON pointer reference token (RFC 6901: ``~`` → ``~0``, ``/`` → ``~1``)."""
    return token.replace("~", "~0").replace("/", "~1")
