"""Row ids: what a good row's id is, what a bad row's error row is called, and which row an id belongs to."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from batchgen.errors import NOT_UNICODE, RowError, is_unicode_text, shown_value
from batchgen.io.input_row import InputRow
from batchgen.sampling.plain_values import whole_number

# The id of the error row of a row whose id is unknown: a line that is not a JSON object (its index may be another
# row's id: found by helpers, it made a good row a "duplicate", or an id appear twice), or a null one where ids come
# from a column. A row whose id is the text "null" is still its own row (claims_id).
NO_ID = "null"


def error_row_id(row: InputRow) -> str:
    """The id of the error row a bad ``row`` becomes: its id as :func:`check_id` gives it (the row index when it
    has none), or, when the id itself is bad, that value as :func:`id_text` writes it; :data:`NO_ID` where the id
    comes from a column (``--id-column``, an OpenAI line's ``custom_id``) that has none, whose index is no id of the
    row's."""
    value = row.data.get("id")
    if value is None:
        return NO_ID if "id" in row.columns else str(row.index)
    return id_text(value)


def id_text(value: Any) -> str:
    """The id column's text for an id ``value`` (not null): a good id as :func:`check_id` takes it (an integral
    float as its integer: pandas writes an integer column with nulls as floats), a bad one as JSON (``true``,
    ``1.5``, ``""``: as the input wrote it; a lone surrogate as its ``\\u`` escape, since the column holds text)."""
    value = whole_number(value)
    if id_problem(value) is None:
        return str(value)
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if is_unicode_text(text) else json.dumps(value, default=repr)


def claims_id(item: InputRow | RowError, index_ids: bool) -> bool:
    """Whether an input row takes its id, so that a later row giving that id is a duplicate: a row whose id is a
    good one (:func:`check_id`; an OpenAI line's ``custom_id`` a non-empty string), and, where a row without an id
    takes its index (``index_ids``), a row without one. A bad id (``true``; an OpenAI line's ``5``), a null one
    where ids come from a column, and an unreadable line claim none: their error rows' ids (``true``, ``5``,
    :data:`NO_ID`) are no ids of theirs."""
    if isinstance(item, RowError):
        return False
    value = item.data.get("id")
    if value is None:
        return index_ids
    bad_custom_id = item.problem is not None and item.problem[0] == "custom_id"
    return not bad_custom_id and id_problem(whole_number(value)) is None


def check_id(value: Any, index: int, fail: Callable[[str, str], RowError]) -> str:
    """A good row's id: ``value`` as its text, the row's ``index`` where it is null.

    Raises:
        RowError: (``fail``'s, for the field ``id``) ``value`` is no id (:func:`id_problem`).
    """
    value = whole_number(value)
    if value is None:
        return str(index)
    problem = id_problem(value)
    if problem is not None:
        raise fail("id", problem)
    return str(value)


def id_problem(value: Any) -> str | None:
    """Why ``value`` (not null) cannot be a row id, or ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return f"must be a string or an integer, got {shown_value(value)}"
    if isinstance(value, str) and not value.strip():
        # Most often an unset template variable; and no result could be looked up by it.
        return 'must not be empty or blank (leave "id" out for the row\'s index)'
    if isinstance(value, str) and not is_unicode_text(value):
        return NOT_UNICODE
    return None
