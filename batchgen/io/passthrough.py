"""The fields of an input row that batchgen reads, and those it passes through to the output: their output
column names and Arrow types (inferred from the JSONL rows read ahead)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from batchgen.io.arrow_fit import misfit
from batchgen.io.writer import OUTPUT_COLUMNS
from batchgen.sampling.sampling_params import SAMPLING_FIELD_ALIASES, SAMPLING_FIELDS

PROMPT_FIELDS: tuple[str, ...] = ("prompt", "messages", "prompt_token_ids")
# Text scored after a prompt or messages (batchgen.job.continuation).
CONTINUATION_FIELD = "continuation"
# Fields batchgen interprets itself; every other input field is copied to the output unchanged.
KNOWN_FIELDS: frozenset[str] = frozenset(
    ("id", *PROMPT_FIELDS, CONTINUATION_FIELD, *SAMPLING_FIELDS, *SAMPLING_FIELD_ALIASES)
)
# `id` is both known and an output column; it is never a pass-through field, so it never collides.
_COLLIDING: frozenset[str] = frozenset(OUTPUT_COLUMNS.names) - {"id"}

# Field metadata of a pass-through column stored as JSON text: its values in the JSONL rows the schema is inferred
# from share no one Arrow type (a number and a string; objects whose members differ in type).
JSON_TEXT_METADATA = {b"batchgen_encoding": b"json"}

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


def infer_schema(rows: list[dict[str, Any]], names: dict[str, str]) -> pa.Schema:
    """Infer the pass-through schema of the read-ahead JSONL rows, a column for each field of ``names``
    (:func:`passthrough_names`): each field's Arrow type, or JSON text (:data:`JSON_TEXT_METADATA`) where its
    values share no one type."""
    columns: dict[str, list[Any]] = {}
    for i, row in enumerate(rows):
        for key, value in row.items():
            if key not in names:
                continue
            # Rows without the field are nulls; padding keeps each list aligned with `rows`.
            values = columns.setdefault(names[key], [None] * i)
            values.extend([None] * (i - len(values)))
            values.append(value)
    fields = []
    for name, values in columns.items():
        arrow_type = infer_type(values)
        if arrow_type is None:
            fields.append(pa.field(name, pa.string(), metadata=JSON_TEXT_METADATA))
        else:
            fields.append(pa.field(name, arrow_type))
    return pa.schema(fields)


def is_json_text(field: pa.Field) -> bool:
    """Whether pass-through ``field`` holds its values as JSON text (see :func:`infer_type`)."""
    metadata = field.metadata or {}
    return all(metadata.get(key) == value for key, value in JSON_TEXT_METADATA.items())


def infer_type(values: list[Any]) -> pa.DataType | None:
    """One column's Arrow type, inferred by pyarrow from Python values (integers and floats together give
    ``double``; objects give a struct of all their keys); null parts become ``string``. ``None`` when pyarrow
    can build no one array that holds them all unchanged (a number and a string, a boolean and a number, an
    integer beyond 64 bits), or when only empty objects give a struct its type (a struct of no fields, which
    Parquet cannot store and no later object with a key would fit): such a column passes through as JSON text,
    so that no row is lost over a field batchgen does not read.
    """
    try:
        arrow_type = _null_to_string(pa.array(values).type)
    except (pa.ArrowException, TypeError, ValueError, OverflowError, UnicodeError):
        return None
    if _has_empty_struct(arrow_type):
        return None
    # pyarrow's inference also converts: [1.5, true] makes a double column holding 1.0 for true.
    if any(misfit(value, arrow_type) is not None for value in values if value is not None):
        return None
    return arrow_type


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


def _has_empty_struct(t: pa.DataType) -> bool:
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _has_empty_struct(t.value_type)
    if pa.types.is_struct(t):
        return t.num_fields == 0 or any(_has_empty_struct(t.field(i).type) for i in range(t.num_fields))
    return False


def json_type_name(value: Any) -> str:
    """Return the JSON name of a decoded value's type (``object``, ``array``, ``string``, ...)."""
    return "null" if value is None else _JSON_TYPE_NAMES.get(type(value), type(value).__name__)
