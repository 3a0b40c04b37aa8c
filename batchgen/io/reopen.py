"""Turn a finished Arrow IPC or Parquet output into a partial output (``OUT.partial/``) again, so that ``--resume``
can add the rows it lacks (see ``batchgen/io/partial_output.py`` for the partial output)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from batchgen.errors import BatchgenError
from batchgen.io.durable import fsync_dir
from batchgen.io.finished_output import finished_batches
from batchgen.io.input_digests import UNKNOWN_DIGEST
from batchgen.io.part_file import rows_sample_ids
from batchgen.io.partial_output import PartialOutput

# Rows per part of a reopened output (whole rows: a row's samples are never split across parts).
_PART_ROWS = 8192


def reopen_output(partial: PartialOutput, schema: pa.Schema, digests: Mapping[str, bytes] | None) -> None:
    """Make the finished output ``partial.out`` the partial output of a run of ``schema`` (whose columns are the
    output's): its rows become the parts, durable before the output is removed; a crash in between leaves the
    output, and the next ``--resume`` (which drops a partial output found beside a finished one) reopens it again.
    ``partial`` keeps the directory's lock: the run that goes on to write it holds it throughout.

    ``digests`` are the input digest of each id with samples (``None``: none known), which each part records for its
    rows (:mod:`batchgen.io.part_file`).

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
                    partial.write_part(pending, _digests_of(pending, digests))
                    pending = []
                pending.append(row)
        partial.write_part(pending, _digests_of(pending, digests))
        out.unlink()
        fsync_dir(out.parent)
    except (OSError, pa.ArrowException) as e:
        raise BatchgenError(f"{out}: cannot reopen the output to add its missing rows: {e}") from None


def _digests_of(rows: list[dict[str, Any]], digests: Mapping[str, bytes] | None) -> bytes | None:
    """The digests a part of ``rows`` records (:func:`~batchgen.io.part_file.sample_ids`' order)."""
    if digests is None:
        return None
    return b"".join(digests.get(rid, UNKNOWN_DIGEST) for rid in rows_sample_ids(rows))
