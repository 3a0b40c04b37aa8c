"""One part file of a partial output (``part-N-<16 hex>.arrow``, see ``batchgen/io/partial_output.py``): its name,
its durable write, reading it back checked, and the digests of the input rows it records.

A part's schema metadata is the job's, plus :data:`~batchgen.io.input_digests.INPUT_DIGESTS_KEY`: the digest
(:func:`~batchgen.io.input_digests.row_digest`) of the input row of each id whose samples it holds, in the order of
:func:`sample_ids`. A resume from a dataset whose fingerprint changed (a copy, a ``touch``, rows added or edited)
checks each row done against the digest of the part whose samples count, one by one, where it could only refuse the
whole output before; a part written by an older batchgen records none.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.io.input_digests import (
    INPUT_DIGESTS_KEY,
    UNKNOWN_DIGEST,
    decode_digests,
    encode_digests,
    split_digests,
)

PART = re.compile(r"part-(\d+)-([0-9a-f]{16})\.arrow")


def part_name(number: int, data: pa.Buffer) -> str:
    """The name of part ``number`` whose bytes are ``data``: its number and the first 16 hex digits of its SHA-256."""
    return f"part-{number:06d}-{hashlib.sha256(data).hexdigest()[:16]}.arrow"


def sample_ids(ids: Iterable[str], finish_reasons: Iterable[str | None]) -> list[str]:
    """The ids of a part's rows with samples (not error rows), each once, in order: the ids its digests are of."""
    return list(dict.fromkeys(rid for rid, reason in zip(ids, finish_reasons, strict=True) if reason != "error"))


def encode_part(rows: list[dict[str, Any]], schema: pa.Schema, digests: bytes | None) -> pa.Buffer:
    """The bytes of a part holding ``rows`` (dicts of ``schema``'s columns), recording the input ``digests`` of the
    rows with samples, in the order of :func:`sample_ids` (concatenated :func:`~batchgen.io.input_digests.row_digest`
    values; ``None``: records none).

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


def part_digests(table: pa.Table) -> dict[str, bytes] | None:
    """The input digest of each id with samples in a part read by :func:`read_part`
    (:data:`~batchgen.io.input_digests.UNKNOWN_DIGEST` for each where it records other than one per id: its rows
    read as changed); ``None`` for a part that records none (an older batchgen's)."""
    value = (table.schema.metadata or {}).get(INPUT_DIGESTS_KEY.encode())
    if value is None:
        return None
    ids = sample_ids(table.column("id").to_pylist(), table.column("finish_reason").to_pylist())
    try:
        digests = split_digests(decode_digests(value.decode("ascii", "replace")))
    except ValueError:
        digests = []
    if len(digests) != len(ids):
        digests = [UNKNOWN_DIGEST] * len(ids)
    return dict(zip(ids, digests, strict=True))


def rows_sample_ids(rows: list[dict[str, Any]]) -> list[str]:
    """:func:`sample_ids` of rows given as dicts (a part about to be written)."""
    return sample_ids((row["id"] for row in rows), (row["finish_reason"] for row in rows))


def job_schema(table: pa.Table) -> pa.Schema:
    """The job's schema as a part carries it: the part's own, without the digests of its rows."""
    metadata = dict(table.schema.metadata or {})
    metadata.pop(INPUT_DIGESTS_KEY.encode(), None)
    return table.schema.with_metadata(metadata)
