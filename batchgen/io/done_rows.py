"""Which input rows a partial output already holds, by ``id``, so that a resumed run skips exactly those.

A row is done when all of its ``n`` samples are in the output, or when it was written as an error row
(``--on-error skip``). The run hands the samples of a row to the part writer together, so they always land in
one part file; should an older part still hold some samples of a row that a later part holds again (a row found
incomplete and generated anew), only the later part's samples count: the older ones are superseded and left
out of the final output. An error row stands for one input row of its own (a duplicate ``id`` is an error row next
to the real row with that id), matched by its id and message: a run that reads the whole dataset meets each error
row again where its row still fails so, and leaves out those it did not meet (a row fixed since, failing otherwise
now, or gone), as an uninterrupted run of the dataset as it is would have written no such row.
"""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc


class DoneRows:
    """The done rows of a partial output: sample counts and error rows by id, and the rows superseded since (samples
    generated again, error rows of bad rows fixed since).

    Memory: one dict entry per done id (the ids a resumed run skips), plus one per error row.
    """

    def __init__(self) -> None:
        # id → number of sample rows in the latest part holding sample rows of that id.
        self.samples: dict[str, int] = {}
        # (id, message) → error rows not yet met by an input row of this run (see take_error).
        self.errors: Counter[tuple[str, str]] = Counter()
        self.error_rows = 0
        # id → the part whose samples count, only for ids with sample rows in more than one part.
        self.latest_part: dict[str, int] = {}

    def add_part(self, part: int, table: pa.Table) -> None:
        """Count the rows of part number ``part`` (``id``, ``finish_reason`` and ``error`` are read)."""
        ids = table.column("id").to_pylist()
        is_error = [reason == "error" for reason in table.column("finish_reason").to_pylist()]
        counts: Counter[str] = Counter(rid for rid, error in zip(ids, is_error) if not error)
        if any(is_error):
            for rid, error, message in zip(ids, is_error, table.column("error").to_pylist()):
                if error:
                    self.errors[rid, message or ""] += 1
                    self.error_rows += 1
        for rid, count in counts.items():
            if rid in self.samples:
                self.latest_part[rid] = part
            self.samples[rid] = count

    def note_written(self, part: int, sample_ids: list[str]) -> None:
        """Record that this run wrote part ``part``; its ids that were already present supersede their old rows."""
        for rid in sample_ids:
            if rid in self.samples:
                self.latest_part[rid] = part

    def is_done(self, rid: str, n: int) -> bool:
        """Whether the row ``rid`` with ``n`` samples has all of them."""
        return self.samples.get(rid) == n

    def take_error(self, rid: str, message: str) -> bool:
        """Whether an error row for ``rid`` with ``message`` is already written; each one answers ``True`` once (a
        row that fails as it did when the row was written: the same message names its line, field and reason)."""
        if self.errors[rid, message] > 0:
            self.errors[rid, message] -= 1
            return True
        return False

    @property
    def count(self) -> int:
        """Input rows done: rows with their samples, plus error rows."""
        return len(self.samples) + self.error_rows

    def superseded_in(self, part: int, table: pa.Table) -> pa.Array | None:
        """A mask of the rows of part ``part`` to leave out, or ``None`` when there are none: superseded samples, and
        error rows the run did not meet again (:meth:`take_error`). Called once per part, in order, when every input
        row has been read: it counts those error rows down."""
        stale = [rid for rid, latest in self.latest_part.items() if latest != part]
        mask = None
        if stale:
            mask = pc.and_(
                pc.is_in(table.column("id"), value_set=pa.array(stale, pa.string())),
                pc.not_equal(pc.fill_null(table.column("finish_reason"), ""), "error"),
            )
        unmet = {key for key, count in self.errors.items() if count > 0}
        if unmet:
            ids = pa.array(sorted({rid for rid, _ in unmet}), pa.string())
            candidates = pc.and_(
                pc.equal(pc.fill_null(table.column("finish_reason"), ""), "error"), pc.is_in(table.column("id"), ids)
            )
            left_out = [False] * table.num_rows
            for row in pc.indices_nonzero(candidates).to_pylist():  # error rows are few: their ids and messages
                key = (table.column("id")[row].as_py(), table.column("error")[row].as_py() or "")
                if self.errors[key] > 0:
                    self.errors[key] -= 1
                    left_out[row] = True
            mask = pa.array(left_out) if mask is None else pc.or_(mask, pa.array(left_out))
        return mask if mask is not None and pc.any(mask).as_py() else None
