"""One row of a dataset, as its reader yields it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass(frozen=True)
class InputRow:
    """One input row, as read from the dataset.

    Attributes:
        index: 0-based row index in the dataset, counted across its shards (the default ``id``); blank JSONL lines
            get none.
        line: 1-based line number (JSONL, blank lines counted) or 1-based row number (Parquet, Arrow) in its shard.
        data: the row's fields with their original names, and the fields the column options set from them
            (:mod:`batchgen.io.columns`). Parquet nulls are left out, so a null and an absent field mean the same
            thing ("not set").
        source: the shard's name, for messages (``""``: the caller's ``source``).
        columns: the dataset column each field the column options set came from (``{"prompt": "question"}``), so
            that a message names the column the user knows.
        problem: ``(column, message)`` when the column options could not map the row: it is a bad row.
        struct_nulls: a Parquet or Arrow row, whose objects are structs: an object holds every key the column's
            objects have, null where it has none (:mod:`batchgen.io.chat_messages` leaves those out of tool calls).
    """

    index: int
    line: int
    data: dict[str, Any]
    source: str = ""
    columns: dict[str, str] = field(default_factory=dict)
    problem: tuple[str, str] | None = None
    struct_nulls: bool = False


class FieldPlace(NamedTuple):
    """Where a field of a JSON Lines dataset is: the first row that has it and how many rows do.

    Attributes:
        source: that row's shard, as :attr:`InputRow.source` names it.
        line: that row's 1-based line in it.
        rows: the dataset's rows that have the field.
    """

    source: str
    line: int
    rows: int

    def __str__(self) -> str:
        more = self.rows - 1
        return f"{self.source}:{self.line}" + (f" and {more} more row{'s' * (more > 1)}" if more else "")
