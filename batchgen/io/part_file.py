"""One part file of a partial output (``part-N-<16 hex>.arrow``, see ``batchgen/io/partial_output.py``): its name,
its durable write, reading it back checked, and the digests of the input rows it records.

A part's schema metadata is the job's, plus :data:`~batchgen.io.input_digests.INPUT_DIGESTS_KEY`: the digests
(:func:`~batchgen.io.input_digests.row_digest`) of the input rows whose samples it holds, in any order. A resume
from a dataset whose fingerprint changed (a copy, a ``touch``, rows added or edited) checks the rows done against
them one by one, as it checks a finished output's, where it could only refuse the whole output before; a part
written by an older batchgen records none.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.io.input_digests import INPUT_DIGESTS_KEY, encode_digests

PART = re.compile(r"part-(\d+)-([0-9a-f]{16})\.arrow")


def part_name(number: int, data: pa.Buffer) -> str:
    """The name of part ``number`` whose bytes are ``data``: its number and the first 16 hex digits of its SHA-256."""
    return f"part-{number:06d}-{hashlib.sha256(data).hexdigest()[:16]}.arrow"


def encode_part(rows: list[dict[str, Any]], schema: pa.Schema, digests: bytes | None) -> pa.Buffer:
    """The bytes of a part holding ``rows`` (dicts of ``schema``'s columns), recording the input ``digests`` of the
    rows with samples (concatenated :func:`~batchgen.io.input_digests.row_digest` values; ``None``: records none).

    Raises:
        pyarrow.ArrowInvalid, pyarrow.ArrowTypeError: a value does not fit its column.
    """
    if digests is not None:
        recorded = {INPUT_DIGESTS_KEY.encode(): encode_digests(digests).encode()}
        schema = schema.with_metadata({**(schema.metadata or {}), **recorded})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(pa.RecordBatch.from_pylist(rows, schema=schema))
    return sink.getvalue()


def write_part_file(path: Path, data: pa.Buffer) -> None:
    """Write and fsync one part under its temporary name.

    Raises:
        OSError: the file system failed.
    """
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_part(path: Path, digest: str) -> pa.Table | None:
    """The part's rows, or ``None`` when its bytes do not hash to ``digest`` (the hex digits of its name) or do not
    parse as Arrow IPC of an output's rows."""
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest()[:16] != digest:
        return None
    try:
        table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
    except (pa.ArrowException, ValueError):
        return None
    return table if {"id", "finish_reason"} <= set(table.column_names) else None


def part_digests(table: pa.Table) -> str | None:
    """The input digests a part read by :func:`read_part` records, as the metadata holds them; ``None`` for a part of
    an older batchgen."""
    value = (table.schema.metadata or {}).get(INPUT_DIGESTS_KEY.encode())
    return None if value is None else value.decode("ascii", "replace")


def job_schema(table: pa.Table) -> pa.Schema:
    """The job's schema as a part carries it: the part's own, without the digests of its rows."""
    metadata = dict(table.schema.metadata or {})
    metadata.pop(INPUT_DIGESTS_KEY.encode(), None)
    return table.schema.with_metadata(metadata)
