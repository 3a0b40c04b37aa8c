"""Values from numpy, torch and JSON writers as the plain Python values the row checks take."""

from __future__ import annotations

from typing import Any

# Modules whose arrays and scalars hold Python values (tolist): numpy's (pandas' rows), torch's (a tokenizer's ids).
ARRAY_MODULES = ("numpy", "torch")


def python_value(value: Any) -> Any:
    """numpy's and torch's scalars and arrays (what rows from pandas, numpy or a tokenizer hold) as the Python values
    they hold, arrays and tuples as lists, inside lists and dicts too: the Python API's values as the checks,
    written for JSON's, take them."""
    if type(value).__module__ in ARRAY_MODULES and hasattr(value, "tolist"):
        value = value.tolist()  # an object array's items stay as they are (pandas' nested lists: arrays again)
    if isinstance(value, dict):
        return {key: python_value(item) for key, item in value.items()}
    return [python_value(item) for item in value] if isinstance(value, (list, tuple)) else value


def whole_number(value: Any) -> Any:
    """A float with no fraction as an int (4.0 → 4): what pandas writes for an integer column with nulls, and
    what JSON writers give for numbers they hold as floats; every other value unchanged."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
