"""The columns of a resumed output: those of the rows written and this run's combined, the written rows widened to
them where a field's type grew (rows added to a JSONL dataset with a field or an object key of their own, or with
floats where the first rows had integers: the pass-through types come from every row)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import pyarrow as pa

from batchgen.errors import BatchgenError
from batchgen.io.assemble import conform
from batchgen.io.json_text import is_json_text
from batchgen.io.passthrough import unified_type

# The output's column of each pass-through field (``batchgen.io.passthrough.passthrough_names``), as JSON: a field
# named like an output column is renamed, and which name it gets depends on the dataset's other fields.
NAMES_KEY = "batchgen.passthrough_columns"


def combined_columns(
    recorded: pa.Schema, now: pa.Schema, written: Callable[[], Iterable[pa.RecordBatch]]
) -> pa.Schema | None:
    """The columns that hold both the rows written (``recorded``) and this run's (``now``), or ``None`` where none do.

    The recorded columns, in order, then this run's new ones: a field only one side has is null on the other (a bad
    row's ``text``, renamed ``prompt`` since to fix it; a field of rows added to the dataset). A column whose type
    changed takes the type both promote to (:func:`batchgen.io.passthrough.unified_type`: a struct gaining keys,
    ``int64`` widening to ``double``), into which the rows written are cast as the output is assembled
    (:func:`batchgen.io.assemble.conform`); a column written as JSON text stays so, this run's values encoded as
    such. A column written typed whose values now need JSON text, or types that do not promote, do not combine,
    unless the parts that differ hold only nulls in the rows written (``written`` gives them: a field null in every
    row written is a ``string`` column, which takes this run's integers).
    """
    now_fields = {f.name: f for f in now}
    fields = []
    for field in recorded:
        other = now_fields.pop(field.name, None)
        promoted = field.type if other is None else _combined_type(field, other)
        if promoted is None and other is not None:
            observed = _observed_type(written(), field.name)
            if observed is not None and pa.types.is_null(observed):  # nulls only: this run's column as it is
                fields.append(other)
                continue
            promoted = None if observed is None or is_json_text(other) else unified_type(observed, other.type)
        if promoted is None:
            return None
        fields.append(field.with_type(promoted))
    return pa.schema([*fields, *now_fields.values()], metadata=now.metadata)


def _combined_type(written: pa.Field, now: pa.Field) -> pa.DataType | None:
    """The type of a column written as ``written`` that this run writes as ``now`` (see :func:`combined_columns`),
    from the two types alone."""
    if is_json_text(written) or now.equals(written) and not is_json_text(now):
        return written.type
    return None if is_json_text(now) else unified_type(written.type, now.type)


def _observed_type(batches: Iterable[pa.RecordBatch], name: str) -> pa.DataType | None:
    """The type pyarrow infers for the values column ``name`` holds in ``batches``, nulls as null parts (``null``
    for a column of nulls, ``list<null>`` for empty lists), or ``None`` where they share none."""
    observed: pa.DataType | None = pa.null()
    for batch in batches:
        if observed is None or name not in batch.schema.names:  # a part written before the column was
            continue
        column = batch.column(name)
        if column.null_count == len(column):
            continue
        try:
            observed = unified_type(observed, pa.array(column.to_pylist()).type)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            return None
    return observed


def columns_for_resume(
    where: Path, recorded: pa.Schema, now: pa.Schema, written: Callable[[], Iterable[pa.RecordBatch]]
) -> pa.Schema:
    """The columns a run resuming the output at ``where`` writes (:func:`combined_columns`).

    Raises:
        BatchgenError: they do not combine (one line naming the columns whose types do not).
    """
    now = _with_recorded_names(recorded, now)
    combined = combined_columns(recorded, now, written)
    if combined is None:
        after = {f.name: f for f in now}
        clashes = [
            f"{f.name} ({_shown(f)} → {_shown(after[f.name])})"
            for f in recorded
            if f.name in after and _combined_type(f, after[f.name]) is None
        ]
        raise BatchgenError(
            f"{where}: cannot resume: the rows written hold columns of another type ({', '.join(clashes)}: the "
            "dataset's values changed, or another batchgen version passes them through differently); pass "
            "--overwrite to start over"
        )
    return combined


def _shown(field: pa.Field) -> str:
    return "JSON text" if is_json_text(field) else str(field.type)


def check_written_rows(written: Iterable[pa.RecordBatch], recorded: pa.Schema, schema: pa.Schema, where: Path) -> None:
    """Check, before any work, that the rows written (``written``, of columns ``recorded``) convert to the columns
    ``schema`` widened, as the output is assembled (:func:`batchgen.io.assemble.conform`); nothing is read where no
    type changed.

    Raises:
        BatchgenError: one does not (an integer a ``double`` cannot hold exactly), or the rows cannot be read.
    """
    if all(f.name not in schema.names or schema.field(f.name).type == f.type for f in recorded):
        return
    target = schema.remove_metadata()
    try:
        for batch in written:
            conform(pa.Table.from_batches([batch]), target)
    except (OSError, ValueError, pa.ArrowException) as e:
        raise BatchgenError(
            f"{where}: cannot resume: the rows written do not convert to this run's columns ({e}); pass --overwrite "
            "to start over"
        ) from None


def _with_recorded_names(recorded: pa.Schema, now: pa.Schema) -> pa.Schema:
    """``now`` with each pass-through field in the column the rows written hold it in, where both record the names
    (:data:`NAMES_KEY`): found by a helper, a dataset that gained an ``input_text`` field beside ``text`` renamed
    ``text``'s column, and the new rows' ``input_text`` went to the column the old rows' ``text`` was in. A new field
    whose own column is taken so gets one more ``input_`` until it is free."""
    then, names = (json.loads((s.metadata or {}).get(NAMES_KEY.encode(), b"null")) for s in (recorded, now))
    if not isinstance(then, dict) or not isinstance(names, dict):
        return now
    kept = {field: then[field] for field in names if field in then}
    taken = set(then.values()) | set(kept.values())
    for field, name in names.items():
        if field not in kept:
            while name in taken:
                name = f"input_{name}"
            kept[field] = name
            taken.add(name)
    kept = {field: kept[field] for field in names}
    column = {names[field]: kept[field] for field in names}
    fields = [f.with_name(column.get(f.name, f.name)) for f in now]
    return pa.schema(fields, metadata={**(now.metadata or {}), NAMES_KEY.encode(): json.dumps(kept).encode()})
