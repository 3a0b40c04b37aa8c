"""A constraint's source text, checked before it is compiled: a JSON schema as JSON text (given as an object or a
string) whose keywords xgrammar enforces, a regex in Python's dialect whose anchors xgrammar keeps, an EBNF
grammar, or a choice of strings as the JSON text of their list; then compiled to an xgrammar ``Grammar``, which
needs no tokenizer (:func:`constraint_grammar`)."""

from __future__ import annotations

import json
import re
from typing import Any

from batchgen.errors import NOT_UNICODE, FieldError, is_unicode_text, shown_value
from batchgen.sampling.json_schema_support import check_enforceable, schema_patterns
from batchgen.sampling.plain_values import python_value
from batchgen.sampling.regex_support import check_regex, python_regex


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
    if name == "choice":
        return _choice_text(value)
    if not isinstance(value, str) or not value:
        raise FieldError(name, f"must be a non-empty string, got {value!r}")
    if name == "regex":
        try:  # the dialect is Python's: what re refuses (\Q...\E, which xgrammar reads as letters) is refused
            re.compile(value)
        except re.error as e:
            raise FieldError(name, f"does not compile as a Python regular expression: {e}") from None
        check_regex(value)
    return value


def _choice_text(value: Any) -> str:
    """A choice (vLLM's ``guided_choice``: a list of strings, or its JSON text, as a flag gives it) as the JSON text
    of the list, its characters unescaped.

    Raises:
        FieldError: not a non-empty list of strings, or a string that UTF-8 cannot encode (a lone surrogate).
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise FieldError("choice", f"must be an array of strings, got {shown_value(value)}") from None
    if not isinstance(value, list | tuple) or not value or not all(isinstance(item, str) for item in value):
        raise FieldError("choice", f"must be a non-empty array of strings, got {shown_value(value)}")
    if not all(is_unicode_text(item) for item in value):
        raise FieldError("choice", NOT_UNICODE)
    if any("\x00" in item for item in value):  # xgrammar's literals end there
        raise FieldError("choice", "a string holds NUL (U+0000), which a grammar cannot take")
    return json.dumps(list(value), ensure_ascii=False)


def choice_ebnf(text: str) -> str:
    """The EBNF grammar whose sentences are exactly the strings of choice ``text`` (a JSON array): one alternative a
    string, each a sequence of JSON string literals, whose escapes (``\\"``, ``\\\\``, ``\\u0001``) xgrammar's
    EBNF reads as JSON does, every control character a literal of its own: xgrammar prints a grammar again as it
    compiles it, writing U+0001 as ``\\x01``, which it then reads with the hex digits after it (``\\x011`` as
    U+0011; found by a helper: the row's text was another string)."""
    return "root ::= " + " | ".join(_literals(item) for item in json.loads(text))


def _literals(item: str) -> str:
    parts = re.findall(r"[\x00-\x1f\x7f]|[^\x00-\x1f\x7f]+", item) or [""]
    return " ".join(json.dumps(part, ensure_ascii=False) for part in parts)


def _plain(value: Any) -> Any:
    """``json.dumps``'s fallback: a numpy value as the Python value it holds; anything else cannot be JSON."""
    plain = python_value(value)
    if plain is value:
        raise TypeError(f"{type(value).__name__} {value!r} is not a JSON value")
    return plain


def import_xgrammar(kind: str) -> Any:
    """The xgrammar module.

    Raises:
        FieldError: naming constraint field ``kind``: xgrammar is not installed.
    """
    try:
        import xgrammar
    except ImportError:
        raise FieldError(kind, "structured output needs xgrammar: pip install 'batchgen[structured]'") from None
    return xgrammar


def constraint_grammar(kind: str, text: str) -> Any:
    """Constraint ``kind`` (``json_schema``, ``regex``, ``ebnf`` or ``choice``) with source ``text`` as an
    ``xgrammar.Grammar``: what no tokenizer is needed for, so that a bad constraint of the run is refused before the
    model loads.

    Raises:
        FieldError: xgrammar is not installed, or the constraint does not compile.
    """
    xgr = import_xgrammar(kind)
    try:
        if kind == "json_schema":
            return xgr.Grammar.from_json_schema(text, any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(python_regex(text))
        return xgr.Grammar.from_ebnf(choice_ebnf(text) if kind == "choice" else text)
    except Exception as e:  # xgrammar raises several types (RuntimeError, ValueError, its own)
        pattern = _failing_pattern(xgr, text) if kind == "json_schema" else None
        raise FieldError(kind, pattern or f"does not compile: {compile_message(e)}") from None


def compile_constraint(compiler: Any, kind: str, text: str) -> Any:
    """Constraint ``kind`` with source ``text`` compiled by ``compiler`` (an ``xgrammar.GrammarCompiler``) from its
    source, as :func:`constraint_grammar` reads it: a ``Grammar`` object would be printed and read again, where
    xgrammar writes U+0080-U+00FF as ``\\xHH`` and reads on through the hex digits after it (``°C`` became U+0B0C in a
    choice, an enum, a property name; a helper), and U+0001 before a digit likewise.

    Raises:
        Exception: xgrammar's (several types), where the source does not compile.
    """
    if kind == "json_schema":
        return compiler.compile_json_schema(text, any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(python_regex(text))
    return compiler.compile_grammar(choice_ebnf(text) if kind == "choice" else text)


def _failing_pattern(xgr: Any, schema_text: str) -> str | None:
    """For a JSON schema xgrammar refuses: its first regex that xgrammar also refuses on its own (compiled as a string
    schema's ``pattern``, the way it reads a schema's regexes), named with its JSON pointer and that refusal
    (``pattern '(a)\\1' at #/properties/x/pattern does not compile: ...``), since the schema's own error gives only
    a position in a regex; ``None`` where every regex compiles (the fault is elsewhere)."""
    for pointer, pattern in schema_patterns(json.loads(schema_text)):
        try:
            xgr.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": pattern}))
        except Exception as e:
            return f"pattern {pattern!r} at {pointer} does not compile: {compile_message(e)}"
    return None


def compile_message(error: Exception) -> str:
    """xgrammar's compile error on one line, without the time and C++ source location its log prefix carries
    (``[22:05:05] /project/cpp/json_schema_converter.cc:5082: Unsupported type "objectx"``), at most 300 characters."""
    text = " ".join(str(error).split())
    text = re.sub(r"^(\[[0-9:]+\] )?\S+\.(cc|cpp|h):\d+: ", "", text)
    return text[:300]
