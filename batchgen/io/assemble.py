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
        ValueError: a part's columns differ from ``schema``'s.
        pyarrow.ArrowException: a part cannot be read.
    """
    passthrough = pa.schema([f for f in schema if f.name not in OUTPUT_COLUMNS.names])
    metadata = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
    rows = 0
    pending: list[pa.RecordBatch] = []
    with open_result_writer(path, passthrough, metadata) as writer:
        for number, part in parts:
            # A memory map: the part's pages are read as they are copied out, and dropped with the table.
            table = pa.ipc.open_file(pa.memory_map(str(part))).read_all().replace_schema_metadata(None)
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
