"""Read Parquet and Arrow IPC shards with pyarrow: their schemas, row counts and record batches, and check that the
shards of one dataset agree on their columns."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import BatchgenError


@contextmanager
def _errors(path: Path, what: str, rows_read: list[int] | None = None) -> Iterator[None]:
    """Raise pyarrow's errors reading ``path`` as one-line BatchgenErrors (its messages span lines), naming the row
    where reading stopped when ``rows_read`` (``[rows read so far]``, kept up to date by the reader) is given: a file
    whose data is damaged (from row 1 on where its first row group is)."""
    try:
        yield
    except (OSError, pa.ArrowException) as e:
        message = str(e.strerror if isinstance(e, OSError) and e.strerror else e)
        detail = " ".join("".join(c if c.isprintable() else " " for c in message).split())  # the damaged bytes too
        at = f" from row {rows_read[0] + 1} on" if rows_read is not None else ""
        if isinstance(e, OSError):
            raise BatchgenError(f"{path}: cannot read{at}: {detail}") from None
        raise BatchgenError(f"{path}: not a valid {what} file{at} ({detail})") from None


def _arrow_batches(path: Path) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """An Arrow IPC file's schema and batches: the stream format (Hugging Face's ``save_to_disk``) or the file
    format (batchgen's ``.arrow`` outputs). Memory-mapped, so a batch costs no read until its values are used."""
    source = pa.memory_map(str(path))
    try:
        stream = pa.ipc.open_stream(source)
        return stream.schema, iter(stream)
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(source)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))


def table_schema(path: Path, fmt: str) -> pa.Schema:
    """The Arrow schema of a ``parquet`` or ``arrow`` shard.

    Raises:
        BatchgenError: the file cannot be read or is not of its format.
    """
    with _errors(path, fmt.capitalize()):
        if fmt == "parquet":
            with pq.ParquetFile(path) as pf:
                return pf.schema_arrow
        return _arrow_batches(path)[0]


def table_num_rows(path: Path, fmt: str) -> int:
    """The rows of a ``parquet`` (from its metadata) or ``arrow`` (counted batch by batch) shard.

    Raises:
        BatchgenError: the file cannot be read or is not of its format.
    """
    with _errors(path, fmt.capitalize()):
        if fmt == "parquet":
            with pq.ParquetFile(path) as pf:
                return int(pf.metadata.num_rows)
        return sum(batch.num_rows for batch in _arrow_batches(path)[1])


def table_batches(path: Path, fmt: str, block_rows: int) -> Iterator[pa.RecordBatch]:
    """The record batches of a ``parquet`` or ``arrow`` shard, at most ``block_rows`` rows each.

    Raises:
        BatchgenError: the file cannot be read or is not of its format.
    """
    rows_read = [0]
    with _errors(path, fmt.capitalize(), rows_read):
        if fmt == "parquet":
            with pq.ParquetFile(path) as pf:
                yield from _parquet_batches(pf, block_rows, rows_read)
            return
        for batch in _arrow_batches(path)[1]:
            batch.validate(full=True)  # damaged values would fail in to_pylist, far from this file's name
            for start in range(0, batch.num_rows, block_rows):
                rows_read[0] += min(block_rows, batch.num_rows - start)
                yield batch.slice(start, block_rows)


def _parquet_batches(pf: pq.ParquetFile, block_rows: int, rows_read: list[int]) -> Iterator[pa.RecordBatch]:
    """The batches of a Parquet file, read a run of row groups of about ``block_rows`` rows at a time (each read has
    a fixed cost, which a file of many small groups, such as a run's output, paid per group). Where a run fails to
    read, its groups are read again one at a time past the rows already given, so that the error names the first row
    of the damaged group (``rows_read``, kept up to date).

    Raises:
        OSError, pyarrow.ArrowException: a group cannot be read.
    """
    runs: list[list[int]] = [[]]
    rows = 0
    for group in range(pf.num_row_groups):
        if rows >= block_rows:
            runs.append([])
            rows = 0
        runs[-1].append(group)
        rows += pf.metadata.row_group(group).num_rows
    for run in runs:
        start = rows_read[0]
        try:
            for batch in pf.iter_batches(batch_size=block_rows, row_groups=run):
                rows_read[0] += batch.num_rows
                yield batch
        except (OSError, pa.ArrowException):
            if len(run) == 1:
                raise
            skip = rows_read[0] - start
            for group in run:
                for batch in pf.iter_batches(batch_size=block_rows, row_groups=[group]):
                    kept = batch.slice(min(skip, batch.num_rows))
                    skip -= batch.num_rows - kept.num_rows
                    if kept.num_rows:
                        rows_read[0] += kept.num_rows
                        yield kept


def unified_schema(schemas: list[tuple[str, pa.Schema]]) -> pa.Schema:
    """One schema for shards ``(name, schema)``: every column of any of them (a column a shard lacks is null in its
    rows), of the type all shards that have it agree on: a column of nulls takes the others' type, and types that
    hold the same values widen to the type that holds both (``string`` and ``large_string``, as pandas and pyarrow
    write them; ``int32`` and ``int64``; ``float32`` and ``float64``), as pyarrow's permissive promotion does.

    Raises:
        BatchgenError: naming the first column two shards give types that do not unify, and the two shards.
    """
    merged: dict[str, pa.Field] = {}
    first_with: dict[str, str] = {}
    for name, schema in schemas:
        for field in schema:
            known = merged.get(field.name)
            if known is None:
                merged[field.name], first_with[field.name] = field, name
                continue
            unified = _unified_type(known.type, field.type)
            if unified is None:
                raise BatchgenError(
                    f"shards disagree on column '{field.name}': {known.type} in {first_with[field.name]}, "
                    f"{field.type} in {name}"
                )
            merged[field.name] = known.with_type(unified).with_nullable(known.nullable or field.nullable)
    return pa.schema(list(merged.values()))


def _unified_type(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """The type of a column that is ``a`` in one shard and ``b`` in another, or ``None`` when none holds both."""
    try:
        return pa.unify_schemas([pa.schema([("c", a)]), pa.schema([("c", b)])]).field("c").type
    except pa.ArrowException:
        pass
    kinds = (pa.types.is_string, pa.types.is_large_string), (pa.types.is_binary, pa.types.is_large_binary)
    for small, large in kinds:
        if (small(a) or large(a)) and (small(b) or large(b)):
            return b if large(b) else a
    if pa.types.is_floating(a) and pa.types.is_floating(b):
        return a if a.bit_width >= b.bit_width else b
    if pa.types.is_integer(a) and pa.types.is_integer(b):
        return _wider_integer(a, b)
    lists = (pa.types.is_list, pa.types.is_large_list)
    if any(kind(a) for kind in lists) and any(kind(b) for kind in lists):
        item = _unified_type(a.value_type, b.value_type)
        large = pa.types.is_large_list(a) or pa.types.is_large_list(b)
        return None if item is None else pa.large_list(item) if large else pa.list_(item)
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        fields = {field.name: field for field in a}
        for field in b:  # a field one side lacks is null in its rows
            known = fields.get(field.name)
            unified = field.type if known is None else _unified_type(known.type, field.type)
            if unified is None:
                return None
            fields[field.name] = field.with_type(unified) if known is None else known.with_type(unified)
        return pa.struct(list(fields.values()))
    return None


def _wider_integer(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """The narrowest integer type that holds every value of both (``None`` for ``uint64`` beside a signed type)."""
    signed = pa.types.is_signed_integer(a) or pa.types.is_signed_integer(b)
    bits = 0
    for t in (a, b):
        needs = t.bit_width * 2 if signed and pa.types.is_unsigned_integer(t) else t.bit_width
        bits = max(bits, needs)
    if bits > 64:
        return None
    return pa.type_for_alias(f"{'int' if signed else 'uint'}{bits}")
