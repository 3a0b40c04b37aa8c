"""Read a finished Arrow IPC or Parquet output back, and turn it into a partial output (``OUT.partial/``) again, so
that ``--resume`` can add the rows it lacks (see ``batchgen/io/partial_output.py`` for the partial output)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import BatchgenError
from batchgen.io.durable import fsync_dir
from batchgen.io.partial_output import PartialOutput

# Rows per part of a reopened output (whole rows: a row's samples are never split across parts).
_PART_ROWS = 8192


def finished_batches(path: Path, columns: list[str] | None = None) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """The schema (with the run's metadata) and the batches (only ``columns``, when given) of the finished Arrow
    IPC or Parquet output ``path``, streamed.

    Raises:
        OSError, pyarrow.ArrowException: the file cannot be read.
    """
    if path.suffix.lower() == ".parquet":
        parquet = pq.ParquetFile(path)
        return parquet.schema_arrow, parquet.iter_batches(columns=columns)
    reader = pa.ipc.open_file(pa.memory_map(str(path)))
    batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    if columns is None:
        return reader.schema, batches
    return reader.schema, (batch.select(columns) for batch in batches)


def finished_ids(path: Path) -> tuple[list[str], set[str], set[str]]:
    """The ``id`` of every row of the finished Arrow IPC or Parquet output ``path``, in its order (a row with n
    samples or a duplicate id's error row appears more than once), the ids of its error rows, and the ids of its
    samples.

    Raises:
        BatchgenError: the file cannot be read.
    """
    ids: list[str] = []
    errored: set[str] = set()
    sampled: set[str] = set()
    try:
        _, batches = finished_batches(path, ["id", "finish_reason"])
        for batch in batches:
            rows = batch.column(0).to_pylist()
            ids += rows
            for rid, why in zip(rows, batch.column(1).to_pylist()):
                (errored if why == "error" else sampled).add(rid)
    except (OSError, pa.ArrowException) as e:
        raise BatchgenError(f"{path}: cannot read results ({e})") from None
    return ids, errored, sampled


def reopen_output(out: Path, schema: pa.Schema) -> None:
    """Make the finished output ``out`` the partial output of a run of ``schema`` (whose columns are ``out``'s):
    its rows become the parts, durable before ``out`` is removed; a crash in between leaves ``out``, and the
    next ``--resume`` (which drops a partial output found beside a finished one) reopens it again.

    Raises:
        BatchgenError: ``out`` cannot be read, or the partial output cannot be written.
    """
    partial = PartialOutput(out)
    partial.start(schema, None)
    try:
        pending: list[dict[str, Any]] = []
        _, batches = finished_batches(out)
        for batch in batches:
            for row in batch.to_pylist():
                # A row's samples are next to each other in the output; a part takes all of them or none.
                if len(pending) >= _PART_ROWS and row["id"] != pending[-1]["id"]:
                    partial.write_part(pending)
                    pending = []
                pending.append(row)
        partial.write_part(pending)
        out.unlink()
        fsync_dir(out.parent)
    except (OSError, pa.ArrowException) as e:
        raise BatchgenError(f"{out}: cannot reopen the output to add its missing rows: {e}") from None
    finally:
        partial.close()
