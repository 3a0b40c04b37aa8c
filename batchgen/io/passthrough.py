"""The fields of an input row that batchgen reads, and those it passes through to the output: their output
column names and Arrow types (for JSON Lines, inferred from all the rows)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pyarrow as pa

from batchgen.errors import is_unicode_text
from batchgen.io.arrow_fit import misfit, same_value, unicode_only
from batchgen.io.json_text import JSON_TEXT_METADATA
from batchgen.io.writer import OUTPUT_COLUMNS
from batchgen.sampling.row_fields import SAMPLING_FIELD_ALIASES, SAMPLING_FIELDS

PROMPT_FIELDS: tuple[str, ...] = ("prompt", "messages", "prompt_token_ids")
# Text scored after a prompt or messages (batchgen.job.continuation).
CONTINUATION_FIELD = "continuation"
# Keyword arguments of a messages row's chat template (vLLM's chat_template_kwargs: {"enable_thinking": false}).
CHAT_TEMPLATE_KWARGS_FIELD = "chat_template_kwargs"
# OpenAI's function definitions, handed to a messages row's chat template (vLLM's tools). Also passed through, as
# every field was before batchgen read it: a dataset of prompts may keep its tools as data (xLAM's).
TOOLS_FIELD = "tools"
# How a messages row's chat template ends the prompt (vLLM's request fields, and LLM.chat's arguments): the
# assistant's turn opened (add_generation_prompt, the default), or the last message left open to be continued.
ADD_GENERATION_PROMPT_FIELD = "add_generation_prompt"
CONTINUE_FINAL_MESSAGE_FIELD = "continue_final_message"
# Fields batchgen reads that pass through too, where the pass-through schema has them (not an OpenAI Batch file's).
READ_AND_PASSED: frozenset[str] = frozenset((TOOLS_FIELD,))
# Fields batchgen interprets itself; every other input field is copied to the output unchanged.
KNOWN_FIELDS: frozenset[str] = frozenset(
    (
        "id",
        *PROMPT_FIELDS,
        CONTINUATION_FIELD,
        CHAT_TEMPLATE_KWARGS_FIELD,
        ADD_GENERATION_PROMPT_FIELD,
        CONTINUE_FINAL_MESSAGE_FIELD,
        *SAMPLING_FIELDS,
        *SAMPLING_FIELD_ALIASES,
    )
)
# The deepest type Arrow's IPC writer takes ("Max recursion depth reached" past it: a JSON value 64 objects deep, found
# by a helper, lost the whole run's output); a deeper field passes through as JSON text.
MAX_TYPE_DEPTH = 64
# `id` is both known and an output column; it is never a pass-through field, so it never collides.
_COLLIDING: frozenset[str] = frozenset(OUTPUT_COLUMNS.names) - {"id"}

_JSON_TYPE_NAMES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def passthrough_names(keys: Iterable[str]) -> dict[str, str]:
    """The output column of each pass-through field ``keys`` names (known fields are left out).

    A field keeps its name, unless that is an output column (``text``, ``error``, ...): then it is renamed
    ``input_<name>``, with one more ``input_`` while that is the name of another field (a dataset with both
    ``text`` and ``input_text`` gives ``input_input_text`` and ``input_text``), so no two fields share a column.
    """
    fields = [key for key in dict.fromkeys(keys) if key not in KNOWN_FIELDS]
    names = {key: key for key in fields if key not in _COLLIDING}
    taken = set(names.values())
    for key in fields:
        if key in _COLLIDING:
            name = f"input_{key}"
            while name in taken:
                name = f"input_{name}"
            names[key] = name
            taken.add(name)
    return {key: names[key] for key in fields}


class SchemaInference:
    """The pass-through schema of JSON Lines rows, inferred from all of them, one block of rows at a time, so that
    every field any row has gets a column and every value fits its column unchanged (as pyarrow's own readers infer
    from a whole file, not a first part of it).

    Each block's values of a field get the type pyarrow infers for them (integers and floats together give
    ``double``; objects a struct of all their keys), or none when no one type holds them all unchanged; the blocks'
    types are then unified as pyarrow promotes them (``pa.unify_schemas(..., promote_options="permissive")``: null
    parts take the other type, structs take the union of their fields, ``int64`` widens to ``double``). A field
    whose values share no type, whose objects are all empty (a struct of no fields, which Parquet cannot store), or
    that nests deeper than :data:`MAX_TYPE_DEPTH`, passes through as JSON text (:data:`JSON_TEXT_METADATA`); one
    that is null in every row is a ``string``.
    """

    def __init__(self) -> None:
        self.keys: dict[str, None] = {}  # every field of every row, known ones too, in order of first appearance
        self._types: dict[str, pa.DataType | None] = {}  # field → its type so far; None: JSON text
        self._promoted: set[str] = set()  # fields whose blocks disagreed: earlier values are checked again

    def add(self, rows: list[dict[str, Any]]) -> None:
        """Take one block of rows into the schema."""
        values: dict[str, list[Any]] = {}
        for row in rows:
            # A name that is not Unicode text names no column: its row is a bad row (batchgen.io.rows.parse_row).
            keys = [key for key in row if is_unicode_text(key)]
            self.keys.update(dict.fromkeys(keys))
            for key in keys:
                value = row[key]
                if key not in KNOWN_FIELDS and value is not None:
                    values.setdefault(key, []).append(value)
        for key, block in values.items():
            block_type = _block_type(block)
            if key not in self._types:
                self._types[key] = block_type
                continue
            known = self._types[key]
            if known is None or known == block_type or block_type is not None and pa.types.is_null(block_type):
                continue
            self._types[key] = None if block_type is None else unified_type(known, block_type)
            self._promoted.add(key)

    def schema(self, names: dict[str, str], rows_again: Callable[[], Iterable[dict[str, Any]]]) -> pa.Schema:
        """The schema of the fields ``names`` maps (:func:`passthrough_names`), under their column names.

        ``rows_again`` gives every row once more; it is called only when blocks disagreed on a field's type, to
        check that the earlier blocks' values fit the unified one (an integer beyond 2**53 does not fit ``double``).
        """
        check = {key for key in self._promoted if self._types[key] is not None}
        if check:
            for row in rows_again():
                for key in check.intersection(row):
                    value = row[key]
                    if value is not None and misfit(value, self._types[key]) is not None and unicode_only(value):
                        self._types[key] = None
                check = {key for key in check if self._types[key] is not None}
                if not check:
                    break
        fields = []
        for key, name in names.items():
            known = self._types.get(key, pa.null())  # a field null in every row has no values to type it
            arrow_type = None if known is None else _null_to_string(known)
            if arrow_type is None or _has_empty_struct(arrow_type) or type_depth(arrow_type) > MAX_TYPE_DEPTH:
                fields.append(pa.field(name, pa.string(), metadata=JSON_TEXT_METADATA))
            else:
                fields.append(pa.field(name, arrow_type))
        return pa.schema(fields)


def _block_type(values: list[Any]) -> pa.DataType | None:
    """The type pyarrow infers for one block's non-null ``values``, null parts kept; ``None`` when pyarrow can build
    no one array holding them all unchanged (a number and a string, a boolean and a number, an integer beyond 64
    bits)."""
    try:
        array = pa.array(values)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        # A lone surrogate makes its row a bad row (batchgen.io.rows.parse_row), which must not decide the type of
        # the good rows' values (found by a helper: a whole column became JSON text).
        kept = [value for value in values if unicode_only(value)]
        if len(kept) == len(values):
            return None
        return _block_type(kept) if kept else pa.null()
    # pyarrow's inference also converts: [1.5, true] makes a double column holding 1.0 for true.
    return array.type if all(map(same_value, values, array.to_pylist())) else None


def unified_type(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """The type pyarrow promotes ``a`` and ``b`` to (``pa.unify_schemas(..., promote_options="permissive")``: null
    parts take the other type, structs the union of their fields, ``int64`` widens to ``double``), or ``None`` when
    there is none (``int64`` and ``string``)."""
    try:
        schema = pa.unify_schemas([pa.schema([("v", a)]), pa.schema([("v", b)])], promote_options="permissive")
    except (pa.ArrowException, TypeError, ValueError):
        return None
    return schema.field("v").type


def _null_to_string(t: pa.DataType) -> pa.DataType:
    # A null type (all values null, or only empty lists) would reject every later non-null value.
    if pa.types.is_null(t):
        return pa.string()
    if pa.types.is_list(t):
        return pa.list_(_null_to_string(t.value_type))
    if pa.types.is_large_list(t):
        return pa.large_list(_null_to_string(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(_null_to_string(t.field(i).type)) for i in range(t.num_fields)])
    return t


def type_depth(t: pa.DataType) -> int:
    """How deep ``t`` nests: 1 for a flat type, one more than its deepest child for a list, struct or map."""
    return 1 + max((type_depth(t.field(i).type) for i in range(t.num_fields)), default=0)


def _nested_types(t: pa.DataType) -> Iterator[pa.DataType]:
    """``t`` and every type within it (a list's values, a struct's or union's fields, a map's entries)."""
    yield t
    for i in range(t.num_fields):
        yield from _nested_types(t.field(i).type)


def _has_empty_struct(t: pa.DataType) -> bool:
    return any(pa.types.is_struct(inner) and inner.num_fields == 0 for inner in _nested_types(t))


def table_column_problem(t: pa.DataType) -> str | None:
    """Why a Parquet or Arrow column of type ``t`` cannot pass through (the words after "column 'NAME'"), or
    ``None``: a union, into which no Python value converts back, or a type nested past :data:`MAX_TYPE_DEPTH`, which
    Parquet reads and Arrow does not write (both found by helpers: every row bad, or a traceback at the first
    flush)."""
    if any(pa.types.is_union(inner) for inner in _nested_types(t)):
        return f"is a union ({t}), which batchgen cannot pass through; drop it, or cast it to one type"
    depth = type_depth(t)
    if depth > MAX_TYPE_DEPTH:
        return f"nests {depth} deep, past the {MAX_TYPE_DEPTH} Arrow writes; drop it, or store it as JSON text"
    return None


def json_type_name(value: Any) -> str:
    """Return the JSON name of a decoded value's type (``object``, ``array``, ``string``, ...)."""
    return "null" if value is None else _JSON_TYPE_NAMES.get(type(value), type(value).__name__)
