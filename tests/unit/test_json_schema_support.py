"""JSON-schema keywords xgrammar does not enforce are refused, at any depth (issue 22, part 3).

The outside reference is ``jsonschema``: each case is an instance it rejects. For a refused schema, xgrammar's
own grammar accepts that instance (so the refusal is needed: were xgrammar to enforce the keyword, the test says
to drop it from the list); for a schema batchgen lets through, xgrammar's grammar rejects it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import numpy as np
import pytest

from batchgen.errors import FieldError
from batchgen.sampling.constraints import constraint_grammar, normalize_constraint
from batchgen.sampling.json_schema_support import check_enforceable

xgrammar = pytest.importorskip("xgrammar", reason='grammars need xgrammar (pip install -e ".[structured]")')
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

INTS = {"type": "array", "items": {"type": "integer"}}
UNIQUE = {**INTS, "uniqueItems": True}
AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}

# (name, schema, an instance the schema rejects, the keyword batchgen names, or None where xgrammar enforces it)
CASES: list[tuple[str, dict[str, Any], Any, str | None]] = [
    ("uniqueItems", UNIQUE, [1, 1], "uniqueItems"),
    ("contains", {**INTS, "contains": {"const": 5}}, [1], "contains"),
    ("minContains", {**INTS, "contains": {"const": 5}, "minContains": 2}, [5, 1], "contains"),
    ("maxContains", {**INTS, "contains": {"const": 5}, "maxContains": 1}, [5, 5], "contains"),
    ("not", {"type": "integer", "not": {"const": 3}}, 3, "not"),
    ("if/then", {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, 9, "if"),
    (
        "dependentRequired",
        {"type": "object", "properties": AB, "dependentRequired": {"a": ["b"]}},
        {"a": 1},
        "dependentRequired",
    ),
    (
        "dependentSchemas",
        {"type": "object", "properties": AB, "dependentSchemas": {"a": {"required": ["b"]}}},
        {"a": 1},
        "dependentSchemas",
    ),
    ("multipleOf number", {"type": "number", "multipleOf": 0.5}, 0.3, "multipleOf"),
    ("multipleOf untyped", {"multipleOf": 7}, 8, "multipleOf"),
    ("multipleOf fraction", {"type": "integer", "multipleOf": 2.5}, 3, "multipleOf"),
    ("multipleOf bounded", {"type": "integer", "multipleOf": 7, "minimum": 3}, 8, "multipleOf"),
    ("pattern+maxLength", {"type": "string", "pattern": "^a+$", "maxLength": 2}, "aaa", "maxLength"),
    ("format+maxLength", {"type": "string", "format": "date", "maxLength": 3}, "2020-01-01", "maxLength"),
    ("allOf", {"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]}, 9, "allOf"),
    ("oneOf overlapping", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, 3, "oneOf"),
    # Found by helper 62: keywords xgrammar drops beside those it takes alone, and names it never writes.
    ("required unlisted", {"type": "object", "required": ["a", "b"]}, {}, "required"),
    ("beside $ref", {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2}, "abc", "maxLength"),
    ("type beside enum", {"type": "integer", "enum": [1, "a", 2.5]}, 2.5, "type"),
    ("beside anyOf", {"type": "string", "anyOf": [{"pattern": "^x"}, {"pattern": "^y"}]}, True, "type"),
    (
        "$dynamicRef",
        {"$defs": {"n": {"$dynamicAnchor": "n", "type": "integer"}}, "$dynamicRef": "#n"},
        "x",
        "$dynamicRef",
    ),
    # Found by helper 82: a $ref that is no pointer into the schema stood for any value, and a pattern's anchors
    # were dropped as a regex row's are.
    ("$ref to an anchor", {"$defs": {"a": {"$anchor": "num", "type": "integer"}}, "$ref": "#num"}, "x", "$ref"),
    ("pattern with a $ inside", {"type": "string", "pattern": "a$b"}, "ab", "pattern"),
    ("pattern with \\A", {"type": "string", "pattern": "\\Aab"}, "Aab", "pattern"),
    (
        "patternProperties with a ^ inside",
        {"type": "object", "patternProperties": {"a^b": {"type": "integer"}}, "additionalProperties": False},
        {"ab": 1},
        "patternProperties",
    ),
    # A review: xgrammar writes a format it knows in place of the pattern beside it.
    ("pattern beside format", {"type": "string", "pattern": "x+", "format": "email"}, "a@b.com", "pattern"),
    # xgrammar drops a lookaround inside a schema's pattern (a regex row's it refuses): '(?=a)b' matches nothing.
    ("pattern with a lookahead", {"type": "string", "pattern": "(?=a)b"}, "b", "pattern"),
    ("pattern with a negative lookahead", {"type": "string", "pattern": "(?!b)b"}, "b", "pattern"),
    (
        "patternProperties with a lookahead",
        {"type": "object", "patternProperties": {"(?=x)y": {"type": "integer"}}, "additionalProperties": False},
        {"y": 1},
        "patternProperties",
    ),
    # Enforced: no refusal, and the grammar itself rejects the instance.
    ("multipleOf integer (B23 jbad)", {"type": "integer", "multipleOf": 7}, 8, None),
    ("allOf of one", {"allOf": [{"type": "integer", "maximum": 5}]}, 9, None),
    ("oneOf of disjoint types", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, 1.5, None),
    ("maxLength", {"type": "string", "maxLength": 1}, "ab", None),
    ("pattern", {"type": "string", "pattern": "^a+$"}, "b", None),
    ("$ref to the root", {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}, [[], []], None),
    ("minimum", {"type": "number", "minimum": 0.5}, 0.25, None),
    ("enum", {"enum": [1, 2]}, 3, None),
    ("maxItems", {**INTS, "maxItems": 1}, [1, 2], None),
    ("additionalProperties", {"type": "object", "properties": AB, "additionalProperties": False}, {"c": 1}, None),
    ("uniqueItems false", {**INTS, "uniqueItems": False, "maxItems": 1}, [1, 1], None),
    ("enum of its type", {"type": "integer", "enum": [1, 2], "title": "t"}, 3, None),
    ("annotations beside $ref", {"$defs": {"s": {"type": "string", "maxLength": 2}}, "$ref": "#/$defs/s"}, "abc", None),
    ("anyOf of optional", {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None}, "x", None),
    # Helper 64: one key repeated still makes one; a type every branch has; drafts 4-7 ignore $ref's siblings.
    ("minProperties 1", {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1}, {}, None),
    (
        "type beside typed branches",
        {
            "type": "object",
            "anyOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}],
            "$defs": {
                "a": {"type": "object", "properties": AB, "required": ["a"]},
                "b": {"type": "object", "properties": AB, "required": ["b"]},
            },
        },
        {},
        None,
    ),
    (
        "draft-07 $ref sibling",
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "definitions": {"s": {"type": "string", "maxLength": 1}},
            "$ref": "#/definitions/s",
            "maxLength": 5,
        },
        "abc",
        None,
    ),
    (
        "discriminated oneOf",
        {
            "oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}],
            "discriminator": {"propertyName": "kind"},
            "$defs": {
                "cat": {
                    "type": "object",
                    "properties": {"kind": {"const": "cat", "type": "string"}},
                    "required": ["kind"],
                },
                "dog": {
                    "type": "object",
                    "properties": {"kind": {"const": "dog", "type": "string"}},
                    "required": ["kind"],
                },
            },
        },
        {"kind": "bird"},
        None,
    ),
    ("oneOf with discriminator", {"oneOf": [{"type": "integer"}, {"type": "string"}], "discriminator": {}}, 1.5, None),
]


def _xgrammar_accepts(schema: dict[str, Any], instance: Any) -> bool:
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return bool(_is_grammar_accept_string(grammar, json.dumps(instance)))


@pytest.mark.parametrize(("name", "schema", "instance", "keyword"), CASES, ids=[c[0] for c in CASES])
def test_no_schema_passes_with_an_unenforced_keyword(
    name: str, schema: dict[str, Any], instance: Any, keyword: str | None
) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(instance, schema)
    if keyword is None:
        check_enforceable(schema)
        assert not _xgrammar_accepts(schema, instance), name
        return
    with pytest.raises(FieldError) as refused:
        check_enforceable(schema)
    assert refused.value.field == "json_schema"
    assert refused.value.message.startswith(f"{keyword} at # is not enforced by xgrammar ("), refused.value.message
    assert _xgrammar_accepts(schema, instance), f"xgrammar now enforces {name}: drop it from the refused keywords"


def _in_object(sub: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"tags": sub}, "required": ["tags"]}


# (schema with uniqueItems nested somewhere, its JSON pointer, an instance jsonschema rejects)
NESTED: list[tuple[dict[str, Any], str, Any]] = [
    (_in_object(UNIQUE), "#/properties/tags", {"tags": [1, 1]}),
    ({"type": "array", "items": UNIQUE}, "#/items", [[1, 1]]),
    ({"type": "array", "prefixItems": [UNIQUE], "items": False}, "#/prefixItems/0", [[1, 1]]),
    ({"type": "object", "additionalProperties": UNIQUE}, "#/additionalProperties", {"x": [1, 1]}),
    ({**_in_object({"$ref": "#/$defs/set"}), "$defs": {"set": UNIQUE}}, "#/$defs/set", {"tags": [1, 1]}),
    (_in_object({"anyOf": [UNIQUE, {"type": "string"}]}), "#/properties/tags/anyOf/0", {"tags": [1, 1]}),
    (_in_object(_in_object({"type": "array", "items": UNIQUE})), "#/properties/tags/properties/tags/items", None),
    ({"type": "object", "properties": {"a/b~": UNIQUE}, "required": ["a/b~"]}, "#/properties/a~1b~0", None),
]


@pytest.mark.parametrize(("schema", "pointer", "instance"), NESTED, ids=[n[1] for n in NESTED])
def test_refusal_names_the_keyword_where_it_is_nested(schema: dict[str, Any], pointer: str, instance: Any) -> None:
    if instance is not None:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(instance, schema)
        assert _xgrammar_accepts(schema, instance)
    with pytest.raises(FieldError, match=re.escape(f"field 'json_schema': uniqueItems at {pointer} is not enforced")):
        normalize_constraint("json_schema", schema)
    with pytest.raises(FieldError, match=re.escape(f"uniqueItems at {pointer} ")):  # the schema given as a JSON string
        normalize_constraint("json_schema", json.dumps(schema))


def test_a_least_count_of_open_keys_is_refused() -> None:
    """xgrammar may write a key twice where keys beyond ``properties`` are allowed and counts it twice: the parsed
    object (the last value of a repeated key wins) has fewer keys than minProperties asks."""
    schema = {
        "type": "object",
        "patternProperties": {"^a$": {"type": "integer"}},
        "additionalProperties": False,
        "minProperties": 2,
    }
    text = '{"a": 7, "a": 3}'
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(text), schema)
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, text)
    with pytest.raises(FieldError, match=re.escape("minProperties at # is not enforced by xgrammar")):
        check_enforceable(schema)
    listed = {"type": "object", "properties": {"a": {}, "b": {}}, "additionalProperties": False, "minProperties": 2}
    check_enforceable(listed)  # only its properties' keys, each written once


def test_keyword_names_as_data_or_property_names_are_not_keywords() -> None:
    schema = {
        "type": "object",
        "properties": {
            "uniqueItems": {"type": "boolean"},
            "not": {"const": {"uniqueItems": True, "not": {}}},
            "mode": {"enum": [{"contains": 1}], "default": {"if": 1}, "examples": [{"oneOf": [1, 2]}]},
        },
        "required": ["uniqueItems"],
    }
    check_enforceable(schema)
    check_enforceable({"type": "array", "items": True, "additionalProperties": False})  # boolean subschemas


def test_a_schema_built_with_numpy_values_is_the_schema_they_hold() -> None:
    """Found by a helper: np.int64 in a schema dict ended in json's TypeError, even under --on-error skip."""
    schema = {"type": "array", "maxItems": np.int64(3), "items": {"enum": np.array(["a", "b"])}}
    assert (
        normalize_constraint("json_schema", schema) == '{"type": "array", "maxItems": 3, "items": {"enum": ["a", "b"]}}'
    )
    with pytest.raises(FieldError, match=r"^field 'json_schema': is not JSON: set \{1\} is not a JSON value$"):
        normalize_constraint("json_schema", {"enum": {1}})
    # Checked as the JSON it is: numpy's values and tuples are what they hold (found by a helper: multipleOf
    # np.int64(2) was refused, an allOf given as a numpy array or a tuple passed unchecked).
    assert normalize_constraint("json_schema", {"type": "integer", "multipleOf": np.int64(2)})
    assert normalize_constraint("json_schema", {"type": "array", "uniqueItems": np.False_})
    both = [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]
    for given in (np.array(both, dtype=object), tuple(both)):
        with pytest.raises(FieldError, match="allOf"):
            normalize_constraint("json_schema", {"allOf": given})


def test_a_ref_under_a_nested_id_is_refused() -> None:
    """Found by helper 83: under a nested ``$id`` a ``#/...`` pointer resolves against that subschema (jsonschema
    takes ``{"p": 2}``), while xgrammar resolves it from the root (it took ``{"p": 1}``)."""
    inner = {"$id": "http://e.example/x", "$defs": {"a": {"type": "integer", "enum": [2]}}, "$ref": "#/$defs/a"}
    schema = {"type": "object", "$defs": {"a": {"type": "integer", "enum": [1]}}, "properties": {"p": inner}}
    schema |= {"required": ["p"], "additionalProperties": False}
    jsonschema.validate({"p": 2}, schema)
    assert _xgrammar_accepts(schema, {"p": 1}) and not _xgrammar_accepts(schema, {"p": 2})
    with pytest.raises(FieldError, match=r"\$id at #/properties/p is not followed by xgrammar beside a \$ref"):
        check_enforceable(schema)


@pytest.mark.parametrize(
    ("pattern", "problem"),
    [("a\\bb", "Word boundary is not supported"), ("(a)\\1", "Backreference is not supported")],
)
def test_a_pattern_xgrammar_cannot_compile_is_named_with_its_pointer(pattern: str, problem: str) -> None:
    schema = {"type": "object", "properties": {"x/y": {"type": "string", "pattern": pattern}}}
    with pytest.raises(FieldError) as refused:
        constraint_grammar("json_schema", normalize_constraint("json_schema", schema))
    pointer = "#/properties/x~1y/pattern"  # RFC 6901 writes the '/' of a name as ~1
    assert refused.value.message.startswith(f"pattern {pattern!r} at {pointer} does not compile: "), refused.value
    assert problem in refused.value.message


def test_a_schema_refused_elsewhere_blames_no_pattern_xgrammar_reads() -> None:
    # xgrammar reads '(?i)' in a schema's pattern (not in a regex row); the fault here is the type.
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?i)a"}, "b": {"type": "objectx"}}}
    with pytest.raises(FieldError) as refused:
        constraint_grammar("json_schema", json.dumps(schema))
    assert refused.value.message == 'does not compile: Unsupported type "objectx"'


# (pattern, a JSON text xgrammar's grammar for it accepts, which does not parse): a pattern naming a quote, a
# backslash or a control character alone, which xgrammar writes unescaped (helper 108: '^a"$' gave "a"").
UNESCAPED = [
    ('^a"$', '"a""'),
    ("^\\\\$", '"\\"'),
    ("^\\x22$", '"""'),
    ("^\\u005c$", '"\\"'),
    ("^\\n$", '"\n"'),
    ('^["]$', '"""'),
    ("^[\\\\]$", '"\\"'),
    # Classes of one character written otherwise (helper 110), and the bell, which xgrammar reads as itself.
    ('^a[""]$', '"a""'),
    ('^["-"]$', '"""'),
    ("^[\\x22-\\x22]$", '"""'),
    ("^\\a$", '"\a"'),
    # A class of several such characters, a quote or backslash among them (helper 111).
    ('^["\\\\]$', '"""'),
    ('^[\\x00-\\x1f"]$', '"""'),
]


@pytest.mark.parametrize(("pattern", "text"), UNESCAPED, ids=[u[0] for u in UNESCAPED])
def test_a_pattern_xgrammar_writes_unescaped_is_refused(pattern: str, text: str) -> None:
    schema = {"type": "string", "pattern": pattern}
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert _is_grammar_accept_string(xgrammar.Grammar.from_json_schema(json.dumps(schema)), text)
    with pytest.raises(FieldError, match="unescaped, so the output would not parse"):
        normalize_constraint("json_schema", {"type": "object", "patternProperties": {pattern: {}}})
    with pytest.raises(FieldError, match=re.escape(f"pattern at # is not enforced by xgrammar ({pattern!r}: ")):
        normalize_constraint("json_schema", schema)


@pytest.mark.parametrize(("pattern", "text"), [("^[ -~]+$", '"a"b"'), ('^[a"]$', '"""'), ("^.+$", '"a\nb"')])
def test_a_class_that_spans_those_characters_leaves_them_out(pattern: str, text: str) -> None:
    """xgrammar leaves them out of any class but one of a single character: the pattern passes, and its grammar
    takes no unparsable text."""
    schema = normalize_constraint("json_schema", {"type": "string", "pattern": pattern})
    assert not _is_grammar_accept_string(constraint_grammar("json_schema", schema), text)


@pytest.mark.parametrize("schema", [{"anyOf": []}, {"oneOf": []}, {"type": []}, {"properties": {"a": {"enum": []}}}])
def test_an_empty_list_no_value_matches_is_refused(schema: dict[str, Any]) -> None:
    """Found by helper 108: an empty anyOf wrote "" (no JSON), an empty type numbers. jsonschema takes no value."""
    validator = jsonschema.Draft202012Validator(schema)
    for value in (1, "a", None, [], True, {"a": 1}):
        instance = value if "properties" not in schema else {"a": value}
        assert not validator.is_valid(instance)
    with pytest.raises(FieldError, match="is an empty list, which no value matches"):
        normalize_constraint("json_schema", schema)
