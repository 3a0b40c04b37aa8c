"""Assemble the final output file from the part files of a partial output, streaming, in bounded memory."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.io.done_rows import DoneRows
from batchgen.io.durable import fsync_file
from batchgen.io.writer import OUTPUT_COLUMNS, ResultWriter, open_result_writer

# Parts are small (one flush each); the output gets batches (Parquet: row groups) of up to this many rows or
# bytes, which readers handle far better than thousands of tiny ones. These bound the memory assembling takes.
COALESCE_ROWS = 65536
COALESCE_BYTES = 32 << 20


def assemble_output(parts: list[tuple[int, Path]], schema: pa.Schema, done: DoneRows, path: Path) -> int:
    """Write the rows of ``parts`` (``(number, path)``, in order) to ``path`` in its extension's format, fsync it,
    and return the number of rows. Superseded samples (see :class:`DoneRows`) are left out.

    Raises:
        BatchgenError: ``path`` cannot be created.
        OSError: writing or syncing failed.
        ValueError: a part's columns differ from ``schema``'s where they do not convert (:func:`conform`).
        pyarrow.ArrowException: a part cannot be read.
    """
    passthrough = pa.schema([f for f in schema if f.name not in OUTPUT_COLUMNS.names])
    metadata = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
    target = schema.remove_metadata()
    rows = 0
    pending: list[pa.RecordBatch] = []
    with open_result_writer(path, passthrough, metadata) as writer:
        for number, part in parts:
            # A memory map: the part's pages are read as they are copied out, and dropped with the table.
            table = conform(pa.ipc.open_file(pa.memory_map(str(part))).read_all(), target)
            stale = done.superseded_in(number, table)
            if stale is not None:
                table = table.filter(pc.invert(stale))
            pending.extend(table.to_batches())
            rows += table.num_rows
            if sum(b.num_rows for b in pending) >= COALESCE_ROWS or sum(b.nbytes for b in pending) >= COALESCE_BYTES:
                _write(writer, pending)
                pending = []
        _write(writer, pending)
    fsync_file(path)
    return rows


def _write(writer: ResultWriter, batches: list[pa.RecordBatch]) -> None:
    if batches:
        for batch in pa.Table.from_batches(batches).combine_chunks().to_batches():
            writer.write_batch(batch)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` (a part's rows) with the columns of ``schema`` (no metadata), in its order: a column whose type
    ``schema`` widened (a struct's new keys null, ``int64`` as ``double``) cast to it, one ``table`` lacks null,
    one ``schema`` lacks left out (a resumed run's columns: :func:`batchgen.job.output_columns.combined_columns`).

    Raises:
        ValueError: a column's values that its new type cannot hold exactly (an integer beyond 2**53 as ``double``),
            naming the column.
    """
    if table.schema.equals(schema):
        return table.replace_schema_metadata(None)
    columns = []
    for field in schema:
        if field.name not in table.column_names:
            columns.append(pa.nulls(table.num_rows, field.type))
            continue
        column = table.column(field.name)
        try:
            columns.append(column if column.type == field.type else column.cast(field.type, safe=True))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise ValueError(f"column {field.name}: its values as {field.type}: {e}") from None
    return pa.Table.from_arrays(columns, schema=schema)
