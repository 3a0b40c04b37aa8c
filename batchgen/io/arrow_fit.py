"""Whether a JSON value can be stored in an Arrow column of a given type without being changed: pyarrow converts
quietly where batchgen must not (a string into a list of its characters, 2.9 into an int64 2, true into 1.0, an
object's extra keys dropped)."""

from __future__ import annotations

import math
from typing import Any

import pyarrow as pa

from batchgen.errors import NOT_UNICODE, is_unicode_text, shown_value

_CONVERSION_ERRORS = (pa.ArrowException, TypeError, ValueError, OverflowError, UnicodeError)


def misfit(value: Any, arrow_type: pa.DataType) -> str | None:
    """Why ``value`` (non-null) does not fit a column of ``arrow_type`` unchanged, in words; ``None`` when it fits.

    It fits when pyarrow converts it and reading it back gives the same value: the same kinds (a boolean stays a
    boolean, a string a string), the same numbers (an integer may widen to an equal float), every object key kept.
    """
    fits = _scalar_fits(value, arrow_type)  # the common flat columns, without a pyarrow round trip per row
    if fits is None:
        try:
            stored = pa.array([value], type=arrow_type).to_pylist()[0]
        except _CONVERSION_ERRORS:
            stored, fits = None, False
        else:
            unknown = _unknown_key(value, arrow_type)
            if unknown is not None and unicode_only(value):
                return f"key '{unknown}' is not in the object type of the other rows ({arrow_type})"
            fits = unknown is None and same_value(value, stored)
    if fits:
        return None
    if not unicode_only(value):
        return NOT_UNICODE
    return f"expected {arrow_type} like the other rows, got {shown_value(value)}"


def unicode_only(value: Any) -> bool:
    """Whether every string within the decoded JSON ``value`` (object keys too) is Unicode text."""
    if isinstance(value, str):
        return is_unicode_text(value)
    if isinstance(value, list):
        return all(map(unicode_only, value))
    if isinstance(value, dict):
        return all(is_unicode_text(key) and unicode_only(item) for key, item in value.items())
    return True


def _scalar_fits(value: Any, arrow_type: pa.DataType) -> bool | None:
    """Whether a string, boolean, int64 or double column stores ``value`` unchanged; ``None`` for other types."""
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return isinstance(value, str) and is_unicode_text(value)
    if pa.types.is_boolean(arrow_type):
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False if pa.types.is_int64(arrow_type) or pa.types.is_float64(arrow_type) else None
    if pa.types.is_int64(arrow_type):
        if isinstance(value, float):
            return value.is_integer() and -(2**63) <= value < 2**63
        return isinstance(value, int) and -(2**63) <= value < 2**63
    if pa.types.is_float64(arrow_type):
        # pyarrow converts an integer to double through int64, so one outside it (or its minimum) fails there.
        return isinstance(value, float) or isinstance(value, int) and -(2**63) < value < 2**63 and float(value) == value
    return None


def same_value(value: Any, stored: Any) -> bool:
    """Whether ``stored`` (``value`` read back from Arrow) is ``value``: the same kinds and numbers, every object key
    kept; struct members ``value`` lacks come back null."""
    if value is None:
        return stored is None
    if isinstance(value, bool) or isinstance(stored, bool):
        return type(value) is type(stored) and value == stored
    if isinstance(value, (int, float)):
        if not isinstance(stored, (int, float)):
            return False
        if isinstance(value, float) and math.isnan(value):
            return isinstance(stored, float) and math.isnan(stored)
        return value == stored
    if isinstance(value, str):
        return isinstance(stored, str) and value == stored
    if isinstance(value, list):
        return isinstance(stored, list) and len(value) == len(stored) and all(map(same_value, value, stored))
    if isinstance(value, dict):
        return isinstance(stored, dict) and all(same_value(item, stored.get(key)) for key, item in value.items())
    return bool(value == stored)  # Parquet's own values (dates, decimals, map entries) come back as they were


def _unknown_key(value: Any, arrow_type: pa.DataType) -> str | None:
    """The first object key within ``value`` (as ``outer.inner``) that ``arrow_type``'s structs, at any depth
    through lists, have no field for; ``None`` when every key has one."""
    if isinstance(value, dict) and pa.types.is_struct(arrow_type):
        names = [arrow_type.field(i).name for i in range(arrow_type.num_fields)]
        for key, item in value.items():
            if key not in names:
                return str(key)
            inner = _unknown_key(item, arrow_type.field(key).type)
            if inner is not None:
                return f"{key}.{inner}"
    elif isinstance(value, list) and (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)):
        for item in value:
            inner = _unknown_key(item, arrow_type.value_type)
            if inner is not None:
                return inner
    return None
