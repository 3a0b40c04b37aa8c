"""A constraint's source text, checked before it is compiled: a JSON schema as JSON text (given as an object or a
string) whose keywords xgrammar enforces, a regex in Python's dialect whose anchors xgrammar keeps, or an EBNF
grammar."""

from __future__ import annotations

import json
import re
from typing import Any

from batchgen.errors import FieldError
from batchgen.sampling.json_schema_support import check_enforceable
from batchgen.sampling.regex_support import check_regex
from batchgen.sampling.sampling_params import python_value


def normalize_constraint(name: str, value: Any) -> str:
    """The constraint's source text; a JSON schema may be given as an object or as a JSON string, and is written
    in ``json.dumps``' form either way.

    Raises:
        FieldError: wrong type, a schema string that is not JSON, a schema with a keyword xgrammar does not
            enforce (:func:`batchgen.sampling.json_schema_support.check_enforceable`), or a regex with an anchor it
            ignores (:func:`batchgen.sampling.regex_support.check_regex`).
    """
    if name == "json_schema":
        if isinstance(value, dict):
            try:  # as JSON first (numpy's values, tuples: a schema built in Python), then checked as the JSON
                text = json.dumps(value, default=_plain)  # key order kept: the order the model writes them in
            except (TypeError, ValueError) as e:
                raise FieldError(name, f"is not JSON: {e}") from None
            check_enforceable(json.loads(text))
            return text
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except json.JSONDecodeError as e:
                raise FieldError(name, f"is not valid JSON: {e.msg}") from None
            if not isinstance(schema, dict):  # as given directly: a schema is an object (true would allow any JSON)
                raise FieldError(name, f"must be a JSON schema object, got {value.strip()[:40]}")
            check_enforceable(schema)
            # Written as an object's is (its key order kept): one schema is one text, given as text or as an
            # object (a flag's and a config file's --json-schema, which a resume compares).
            return json.dumps(schema)
        raise FieldError(name, f"must be a JSON schema object or string, got {value!r}")
    if not isinstance(value, str) or not value:
        raise FieldError(name, f"must be a non-empty string, got {value!r}")
    if name == "regex":
        try:  # the dialect is Python's: what re refuses (\Q...\E, which xgrammar reads as letters) is refused
            re.compile(value)
        except re.error as e:
            raise FieldError(name, f"does not compile as a Python regular expression: {e}") from None
        check_regex(value)
    return value


def _plain(value: Any) -> Any:
    """``json.dumps``'s fallback: a numpy value as the Python value it holds; anything else cannot be JSON."""
    plain = python_value(value)
    if plain is value:
        raise TypeError(f"{type(value).__name__} {value!r} is not a JSON value")
    return plain
