"""Rows given in Python (a prompt string, a message list, a token-id list, or a row dict as in a JSONL file) as
input rows, checked as a file's rows are, with their pass-through fields kept as given."""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import pyarrow as pa

from batchgen.errors import BatchgenError, FieldError, RowError, caller_stacklevel, shown_value
from batchgen.io.columns import CONVERSATIONS, ColumnMapping
from batchgen.io.field_warnings import foreign_field_warning
from batchgen.io.input_options import InputOptions
from batchgen.io.passthrough import KNOWN_FIELDS, PROMPT_FIELDS, READ_AND_PASSED, passthrough_names
from batchgen.io.reader import InputRow
from batchgen.io.rows import RowSpec, parse_row
from batchgen.sampling.plain_values import ARRAY_MODULES, python_value, whole_number
from batchgen.sampling.row_fields import make_sampling_params
from batchgen.sampling.sampling_params import SamplingParams

# The input's name in row errors: ``rows:3: field 'temperature': ...`` is the third row given (1-based, as a
# file's lines are; its default id is its 0-based index, "2").
SOURCE = "rows"

_NO_PASSTHROUGH = pa.schema([])


def call_sampling(caller: str, sampling_params: Any, keywords: Mapping[str, Any]) -> dict[str, Any]:
    """A call's sampling keywords with SGLang's ``sampling_params`` dict (``generate(prompts, {...})``) under them.

    Raises:
        TypeError: ``sampling_params`` is no dict (vLLM's ``SamplingParams`` object, SGLang's list of one per
            prompt) or has a key that is no string or ``on_error``, or it and a keyword give one field.
    """
    if sampling_params is None:
        return dict(keywords)
    if isinstance(sampling_params, (list, tuple)):  # SGLang's list of one dict per prompt
        raise TypeError(
            f"{caller}(): sampling_params must be one dict for every row; a row's own fields go in its row dict "
            "({'prompt': ..., 'temperature': 0})"
        )
    if not isinstance(sampling_params, Mapping):
        raise TypeError(
            f"{caller}(): sampling_params must be a dict of sampling fields, as SGLang's Engine.generate takes it, "
            f"got {type(sampling_params).__name__} (give a vLLM SamplingParams' fields as keywords)"
        )
    if not all(isinstance(name, str) for name in sampling_params):
        raise TypeError(f"{caller}(): sampling_params' keys must be strings (field names)")
    if "on_error" in sampling_params:
        raise TypeError(f"{caller}(): on_error is {caller}()'s own keyword, not a sampling field of sampling_params")
    both = next((name for name in sampling_params if name in keywords), None)
    if both is not None:
        raise TypeError(f"{caller}() got '{both}' both in sampling_params and as a keyword")
    return {**sampling_params, **keywords}


def check_row_fields(fields: Mapping[str, Any], vocab_size: int) -> None:
    """Check the row fields a call gives every row (:data:`~batchgen.sampling.row_fields.ROW_FIELD_KEYWORDS`),
    once, as a row's are checked.

    Raises:
        BatchgenError: ``json_schema: ...``, the first bad one named.
    """
    try:
        make_sampling_params(SamplingParams(), dict(fields), vocab_size)
    except FieldError as e:
        raise BatchgenError(f"{e.field}: {e.message}") from None


def with_row_fields(items: Iterator[InputRow | RowError], fields: Mapping[str, Any]) -> Iterator[InputRow | RowError]:
    """``items``, each row given the ``fields`` it does not set itself."""
    for item in items:
        if fields and isinstance(item, InputRow):
            added = {name: value for name, value in fields.items() if item.data.get(name) is None}
            item = replace(item, data={**item.data, **added})
        yield item


def input_rows(rows: Iterable[Any], options: InputOptions) -> Iterator[InputRow | RowError]:
    """Each of ``rows`` as an input row, read as it is reached: a ``str`` is a prompt, a list of integers
    ``prompt_token_ids``, another list ``messages``, a dict the row's fields (mapped by the column ``options``,
    checked against the first dict's keys as a file's against its first shard); anything else is a bad row. In a
    dict, a float NaN in a field batchgen reads is a missing value, as pandas writes one in ``to_dict('records')``.

    A lone prompt string, row dict, token-id list (a list or 1-D array of integers) or message list (dicts with a
    ``role`` and no prompt field) is one row, as vLLM's ``LLM.generate`` takes one prompt and ``LLM.chat`` one
    conversation: iterated, its characters, keys, ids or messages would each become a row (found by new users).

    Raises:
        BatchgenError: a column the options name is not a key of the first dict row; ``rows`` is a DataFrame or a
            tokenizer's output (``input_ids`` with an ``attention_mask``).
    """
    if hasattr(rows, "columns") and hasattr(rows, "to_dict"):
        # A pandas DataFrame iterates its column names, which would each become a prompt (found by a new user).
        raise BatchgenError("rows: a DataFrame iterates its column names, not its rows: pass df.to_dict('records')")
    if isinstance(rows, Mapping) and {"input_ids", "attention_mask"} <= rows.keys():
        # A tokenizer's BatchEncoding (found by an HF user): its padding would be read as prompt tokens.
        raise BatchgenError(
            "rows: a tokenizer's output (input_ids with an attention_mask): give its ids unpadded, a list per row "
            "(tokenizer(prompts)['input_ids'] without padding), or the prompt strings"
        )
    if type(rows).__module__ in ARRAY_MODULES and getattr(rows, "ndim", None) == 2:
        # tokenizer(prompts, padding=True, return_tensors=...)["input_ids"]: its pads would be prompt tokens.
        message = f"{SOURCE}: a 2-D array's rows are taken whole as prompt_token_ids, padding included"
        warnings.warn(message, UserWarning, stacklevel=caller_stacklevel())
    if _is_lone_row(rows, options):
        rows = [rows]
    mapping: ColumnMapping | None = None
    # What batchgen reads: numpy's values as Python's; the rest as given.
    read = KNOWN_FIELDS | READ_AND_PASSED | {CONVERSATIONS} | set(options.columns())  # conversations: ShareGPT's
    for index, row in enumerate(rows):
        line = index + 1
        row = python_value(row) if not isinstance(row, Mapping) else row  # an array of token ids, a numpy string
        if isinstance(row, str):
            yield InputRow(index, line, {"prompt": row})
        elif isinstance(row, list):
            is_ids = bool(row) and all(_is_token_id(t) for t in row)
            yield InputRow(index, line, {"prompt_token_ids" if is_ids else "messages": row})
        elif isinstance(row, Mapping):
            mapping = mapping or ColumnMapping(options, list(row), SOURCE)
            data, columns, problem = mapping.apply(_read_values(row, read))
            yield InputRow(index, line, data, columns=columns, problem=problem)
        else:
            message = f"must be a prompt string, a message list, a token-id list or a dict, got {shown_value(row)}"
            yield RowError(SOURCE, line, None, message)


def _is_lone_row(rows: Iterable[Any], options: InputOptions) -> bool:
    """Whether ``rows`` is one row itself rather than rows: a string, a dict, a non-empty 1-D integer array, a
    non-empty list of token ids, or a non-empty list (or object array) of messages: dicts with a ``role`` and no
    prompt field, when no column option could make a prompt of their fields (then they are rows)."""
    if isinstance(rows, (str, Mapping)):
        return True
    if isinstance(rows, tuple) or (type(rows).__module__ in ARRAY_MODULES and getattr(rows, "ndim", None) == 1):
        rows = python_value(rows)  # a tuple's or an integer array's ids, an object array's messages
    if not isinstance(rows, list) or not rows:
        return False
    if all(_is_token_id(t) for t in rows):
        return True
    if options.columns():
        return False
    return all(isinstance(m, Mapping) and "role" in m and not any(f in m for f in PROMPT_FIELDS) for m in rows)


def _is_token_id(value: Any) -> bool:
    """An integer (numpy's too), or a float with no fraction (as the integer fields take it: 41.0), but no bool."""
    value = whole_number(python_value(value))
    return isinstance(value, int) and not isinstance(value, bool)


def parse_python_row(row: InputRow) -> RowSpec:
    """:func:`batchgen.io.rows.parse_row` for a row given in Python: its pass-through fields (named as a file's
    are: ``input_text`` for ``text``) are kept as they are, any Python value, rather than fitted to an Arrow schema.

    Raises:
        RowError: as ``parse_row`` does.
    """
    names = passthrough_names(row.data)
    if not any(row.data.get(name) is not None for name in PROMPT_FIELDS):
        # parse_row refuses the row before it reads any pass-through field; given them all, its message can say
        # which one looks like the prompt under another name.
        return parse_row(row, SOURCE, _NO_PASSTHROUGH, {})
    known = replace(row, data={k: v for k, v in row.data.items() if k not in names or k in READ_AND_PASSED})
    spec = parse_row(known, SOURCE, _NO_PASSTHROUGH, {})
    return replace(spec, passthrough=python_passthrough(row))


def _read_values(row: Mapping[str, Any], read: Collection[str]) -> dict[str, Any]:
    """``row`` with the fields in ``read`` as Python values (numpy's converted), those that are NaN left out."""
    values: dict[str, Any] = {}
    for key, value in row.items():
        if key in read:
            value = python_value(value)
            if isinstance(value, float) and math.isnan(value):
                continue
        values[key] = value
    return values


def python_passthrough(row: InputRow) -> dict[str, Any]:
    """The pass-through fields of a row given in Python, under their output names, values as given; a field that
    looks like a sampling field batchgen does not read (``Temperature``, vLLM's ``best_of``) is warned about
    (a ``UserWarning``, shown once per field by Python's default filter), as the command line warns about a file's."""
    names = passthrough_names(row.data)
    for key in names:
        warning = foreign_field_warning(key)
        if warning is not None:
            warnings.warn(f"{SOURCE}: {warning}", UserWarning, stacklevel=caller_stacklevel())
    return {names[key]: value for key, value in row.data.items() if key in names}
