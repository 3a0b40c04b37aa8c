"""Where each line of an OpenAI Batch output goes: at its request line's place in the input, as ``vllm run-batch``
writes them (:mod:`batchgen.io.openai_output` renders the lines).

An id's samples are one line, at the place of the row that claims the id (:func:`batchgen.io.row_ids.claims_id`);
error rows are one line each, at their own row's place, found by the ``file:line`` their message begins with, so
that the error lines of rows sharing an id (duplicates, the lines without a usable ``custom_id`` that are all
called ``null``) keep their places whatever order a resumed run wrote them in.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.io.input_digests import input_ids

# Rows taken from the assembled output at a time, in input order.
_TAKE_ROWS = 4096
# Where an error message's ``file:line`` may end: a line number and ": ".
_LINE_END = re.compile(r":\d+: ")


@dataclass
class InputOrder:
    """Where each id's rows are in the input.

    Attributes:
        first: each id → the place (0-based row position) of the row that claims it, or of its first row where none
            does.
        rest: each id of more than one row → the places of its other rows, ascending.
        where: the ``file:line`` of each place in ``first`` or ``rest`` of an id of more than one row.
        rows: the input's row count.
    """

    first: dict[str, int] = field(default_factory=dict)
    rest: dict[str, list[int]] = field(default_factory=dict)
    where: dict[int, str] = field(default_factory=dict)
    rows: int = 0


def input_order(dataset: Path) -> InputOrder:
    """Where each id's rows are in ``dataset``: one pass over it, and a second where ids repeat (``where``)."""
    order, unclaimed = InputOrder(), set()
    for place, (rid, claims, _) in enumerate(input_ids(dataset)):
        order.rows += 1
        if rid not in order.first:
            order.first[rid] = place
            if not claims:
                unclaimed.add(rid)
        elif claims and rid in unclaimed:  # the row that claims the id comes after rows that do not
            order.rest.setdefault(rid, []).append(order.first[rid])
            order.first[rid] = place
            unclaimed.discard(rid)
        else:
            order.rest.setdefault(rid, []).append(place)
    for others in order.rest.values():
        others.sort()
    if order.rest:
        order.where = {place: where for place, (rid, _, where) in enumerate(input_ids(dataset)) if rid in order.rest}
    return order


def requests_in_input_order(table: pa.Table, dataset: Path) -> Iterator[list[dict[str, Any]]]:
    """The rows of ``table`` (result rows of a run from ``dataset``) grouped by request (an id's samples together,
    by index; each error row alone), in input order (:func:`places`); rows whose id the input lacks last."""
    if not table.num_rows:
        return
    errors = pc.fill_null(pc.equal(table.column("finish_reason"), "error"), False)
    keys = pa.table(
        {
            "place": places(table, input_order(dataset)),
            "error": errors,
            "sample": pc.fill_null(table.column("sample_index"), 0),
        }
    )
    indices = pc.sort_indices(keys, sort_keys=[(name, "ascending") for name in keys.column_names])
    group: list[dict[str, Any]] = []
    for start in range(0, len(indices), _TAKE_ROWS):
        for row in table.take(indices[start : start + _TAKE_ROWS]).to_pylist():
            error = row["finish_reason"] == "error"
            if group and (error or group[0]["finish_reason"] == "error" or row["id"] != group[0]["id"]):
                yield group
                group = []
            group.append(row)
    yield group


def places(table: pa.Table, order: InputOrder) -> pa.Array:
    """Each row's place in the input (int64): an id's samples at the place of the row that claims it, an error row
    of an id of several rows at the place of the row its message names (``file:line: ...``; else the next free
    place of its id, in order), any other row at its id's place; ``order.rows`` for an id the input lacks."""
    ids = table.column("id")
    found = pc.index_in(ids, value_set=pa.array(list(order.first), pa.string()))
    place = pc.fill_null(pc.take(pa.array(list(order.first.values()), pa.int64()), found), order.rows)
    if not order.rest:
        return place
    placed = place.to_pylist()
    shared = pc.indices_nonzero(pc.is_in(ids, value_set=pa.array(list(order.rest), pa.string()))).to_pylist()
    rows = table.take(shared).select(["id", "finish_reason", "error"]).to_pylist()
    with_samples = {row["id"] for row in rows if row["finish_reason"] != "error"}
    free = {rid: set(rest) if rid in with_samples else {order.first[rid], *rest} for rid, rest in order.rest.items()}
    at = {order.where[p]: p for spots in free.values() for p in spots}
    unnamed = []
    for i, row in zip(shared, rows):
        if row["finish_reason"] != "error":
            continue
        p = _named_place(row["error"] or "", at)
        if p is not None and p in free[row["id"]]:
            free[row["id"]].discard(p)
            placed[i] = p
        else:
            unnamed.append((i, row["id"]))
    for i, rid in unnamed:  # a message naming no free place of its id: the next one, in order
        if free[rid]:
            placed[i] = min(free[rid])
            free[rid].discard(placed[i])
    return pa.array(placed, pa.int64())


def _named_place(message: str, at: dict[str, int]) -> int | None:
    """The place whose ``file:line`` ``message`` begins with (``file:line: ...``; the file's name may hold ``: ``
    itself, so each ``:N: `` in the message is tried), or ``None``."""
    for end in _LINE_END.finditer(message):
        place = at.get(message[: end.end() - 2])
        if place is not None:
            return place
    return None
