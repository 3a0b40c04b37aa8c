"""Which input rows a partial output already holds, by ``id``, so that a resumed run skips exactly those.

A row is done when all of its ``n`` samples are in the output, or when it was written as an error row
(``--on-error skip``). The run hands the samples of a row to the part writer together, so they always land in
one part file; should an older part still hold some samples of a row that a later part holds again (a row found
incomplete and generated anew), only the later part's samples count: the older ones are superseded and left
out of the final output. Error rows are never superseded: a duplicate ``id`` is an error row next to the real
row with that id, so each error row stands for one input row of its own.
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
        # id → error rows not yet matched with an input row by this run (see take_error).
        self.errors: Counter[str] = Counter()
        self.error_rows = 0
        # id → the part whose samples count, only for ids with sample rows in more than one part.
        self.latest_part: dict[str, int] = {}
        # Ids with error rows that this run wrote samples of (``samples`` holds only those of earlier runs).
        self.errors_with_samples: set[str] = set()

    def add_part(self, part: int, table: pa.Table) -> None:
        """Count the rows of part number ``part`` (``id``, ``sample_index`` and ``finish_reason`` are read)."""
        ids = table.column("id").to_pylist()
        is_error = [reason == "error" for reason in table.column("finish_reason").to_pylist()]
        counts: Counter[str] = Counter(rid for rid, error in zip(ids, is_error) if not error)
        for rid, error in zip(ids, is_error):
            if error:
                self.errors[rid] += 1
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
            if self.errors[rid] > 0:
                self.errors_with_samples.add(rid)

    def is_done(self, rid: str, n: int) -> bool:
        """Whether the row ``rid`` with ``n`` samples has all of them."""
        return self.samples.get(rid) == n

    def take_error(self, rid: str) -> bool:
        """Whether an error row for ``rid`` is already written; each one answers ``True`` once.

        A run meets its error rows in input order, and wrote them in input order, so matching them by count
        pairs each with the input row it was written for.
        """
        if self.errors[rid] > 0:
            self.errors[rid] -= 1
            return True
        return False

    @property
    def count(self) -> int:
        """Input rows done: rows with their samples, plus error rows."""
        return len(self.samples) + self.error_rows

    def superseded_in(self, part: int, table: pa.Table) -> pa.Array | None:
        """A mask of the rows of part ``part`` to leave out, or ``None`` when there are none: superseded samples, and
        error rows that the finished run did not meet again (:meth:`take_error`) of ids that have samples: the row
        was bad, was fixed since and is generated (this run or an earlier resumed one), or a duplicate of the id
        has left the dataset. Called once per part, in order, when every input row has been read: it counts those
        error rows down."""
        stale = [rid for rid, latest in self.latest_part.items() if latest != part]
        mask = None
        if stale:
            mask = pc.and_(
                pc.is_in(table.column("id"), value_set=pa.array(stale, pa.string())),
                pc.not_equal(pc.fill_null(table.column("finish_reason"), ""), "error"),
            )
        unmet_ids = {rid for rid, count in self.errors.items() if count > 0}
        unmet_ids = {rid for rid in unmet_ids if rid in self.samples or rid in self.errors_with_samples}
        if unmet_ids:
            unmet = []
            for rid, reason in zip(table.column("id").to_pylist(), table.column("finish_reason").to_pylist()):
                left_out = reason == "error" and rid in unmet_ids and self.errors[rid] > 0
                if left_out:
                    self.errors[rid] -= 1
                unmet.append(left_out)
            mask = pa.array(unmet) if mask is None else pc.or_(mask, pa.array(unmet))
        return mask if mask is not None and pc.any(mask).as_py() else None
