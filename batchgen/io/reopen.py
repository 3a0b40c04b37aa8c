"""Turn a finished Arrow IPC or Parquet output into a partial output (``OUT.partial/``) again, so that ``--resume``
can add the rows it lacks (see ``batchgen/io/partial_output.py`` for the partial output)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from batchgen.errors import BatchgenError
from batchgen.io.durable import fsync_dir
from batchgen.io.finished_output import finished_batches
from batchgen.io.partial_output import PartialOutput

# Rows per part of a reopened output (whole rows: a row's samples are never split across parts).
_PART_ROWS = 8192


def reopen_output(partial: PartialOutput, schema: pa.Schema, digests: bytes | None) -> None:
    """Make the finished output ``partial.out`` the partial output of a run of ``schema`` (whose columns are the
    output's): its rows become the parts, durable before the output is removed; a crash in between leaves the
    output, and the next ``--resume`` (which drops a partial output found beside a finished one) reopens it again.
    ``partial`` keeps the directory's lock: the run that goes on to write it holds it throughout.

    ``digests`` are the input digests the output records (``None``: none), not matched to its rows: the first part
    records them all, the others none of their own (:mod:`batchgen.io.part_file`).

    Raises:
        BatchgenError: the output cannot be read, the partial output cannot be written, or another run holds its
            lock.
    """
    out = partial.out
    partial.start(schema, None)
    try:
        pending: list[dict[str, Any]] = []
        _, batches = finished_batches(out)
        for batch in batches:
            for row in batch.to_pylist():
                # A row's samples are next to each other in the output; a part takes all of them or none.
                if len(pending) >= _PART_ROWS and row["id"] != pending[-1]["id"]:
                    partial.write_part(pending, digests)
                    pending, digests = [], None if digests is None else b""
                pending.append(row)
        partial.write_part(pending, digests)
        out.unlink()
        fsync_dir(out.parent)
    except (OSError, pa.ArrowException) as e:
        raise BatchgenError(f"{out}: cannot reopen the output to add its missing rows: {e}") from None
