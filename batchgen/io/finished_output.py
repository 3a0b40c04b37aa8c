"""Read a finished output back: its batches, the ids of its rows (samples and error rows apart), its metadata."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.errors import BatchgenError
from batchgen.io.openai_output import result_fields

# What every row of a batchgen output has (an OpenAI Batch output line's, as result_fields reads it).
_RESULT_FIELDS = ("id", "sample_index", "finish_reason")


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


@dataclass
class FinishedRows:
    """The rows of a finished output, by id.

    Attributes:
        ids: the ``id`` of every row, in the file's order (a row with n samples, or a duplicate id's error rows,
            appear more than once).
        samples: the ids of its samples (rows that are not error rows).
        errors: its error rows, counted by id.
        metadata: the run's metadata (Arrow IPC and Parquet; a JSONL output has none).
    """

    ids: list[str] = field(default_factory=list)
    samples: set[str] = field(default_factory=set)
    errors: Counter[str] = field(default_factory=Counter)
    metadata: dict[bytes, bytes] = field(default_factory=dict)

    def add(self, ids: list[str], is_error: list[bool]) -> None:
        """Take rows with ids ``ids``, which are error rows where ``is_error`` says so."""
        self.ids += ids
        for rid, error in zip(ids, is_error, strict=True):
            if error:
                self.errors[rid] += 1
            else:
                self.samples.add(rid)


def records_run(path: Path) -> bool:
    """Whether a finished output at ``path`` records the run that made it (settings, dataset fingerprint, input
    digests) in its metadata, so that ``--resume`` can add the rows it lacks: Arrow and Parquet do; JSON Lines, which
    has no metadata, does not."""
    return path.suffix.lower() != ".jsonl"


def finished_rows(path: Path) -> FinishedRows:
    """The rows of the finished output file ``path`` (any format), read batch by batch.

    Raises:
        BatchgenError: the file cannot be read, or it is no batchgen output: it lacks the ``id``, ``sample_index`` and
            ``finish_reason`` every output row has (another file given as ``--out``, found by a new user: a copy of
            the input was taken for a finished output, "already complete").
    """
    rows = FinishedRows()
    try:
        if not records_run(path):  # JSON Lines
            with path.open(encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        row = _result_line(path, number, line)
                        rows.add([str(row.get("id"))], [row.get("finish_reason") == "error"])
            if not rows.ids:  # batchgen writes no output of no rows
                raise _not_an_output(str(path), [])
            return rows
        schema, batches = finished_batches(path, list(_RESULT_FIELDS))  # the columns are selected as batches come
        if lacking := [name for name in _RESULT_FIELDS if name not in schema.names]:
            raise _not_an_output(str(path), lacking)
        for batch in batches:
            is_error = pc.equal(batch.column("finish_reason"), "error").fill_null(False)
            rows.add(batch.column("id").to_pylist(), is_error.to_pylist())
    except (OSError, ValueError, KeyError, pa.ArrowException) as e:
        raise BatchgenError(f"{path}: cannot read results ({e})") from None
    rows.metadata = schema.metadata or {}
    return rows


def _not_an_output(where: str, lacking: list[str]) -> BatchgenError:
    """The error for a file given as ``--out`` that no run wrote: ``where`` (the file, or its line) lacks the
    ``lacking`` fields of a result row."""
    missing = " or ".join(f"'{name}'" for name in lacking) if lacking else "rows"
    return BatchgenError(
        f"{where}: not a batchgen output (it has no {missing}): is --out the file a run of this dataset wrote?"
    )


def _result_line(path: Path, number: int, line: str) -> dict[str, Any]:
    """Line ``number`` of the JSONL output ``path`` as ``batchgen status`` counts it (:func:`result_fields`).

    Raises:
        BatchgenError: it is no result row (found by a new user: a copy of the input, given as ``--out``, was taken
            for a finished output, "already complete"); ``ValueError``: it is no JSON.
    """
    parsed = json.loads(line)
    row = result_fields(parsed) if isinstance(parsed, dict) else {}
    if lacking := [name for name in _RESULT_FIELDS if name not in row]:
        raise _not_an_output(f"{path}:{number}", lacking)
    return row


def recorded_settings(out: Path) -> dict[str, str] | None:
    """The metadata the finished output ``out`` records, by key; ``None`` for JSON Lines, which records none.

    Raises:
        BatchgenError: ``out`` cannot be read.
    """
    if not records_run(out):
        return None
    try:
        schema, _ = finished_batches(out, ["id"])
    except (OSError, pa.ArrowException) as e:
        raise BatchgenError(f"{out}: cannot read results ({e})") from None
    return schema_metadata(schema)


def schema_metadata(schema: pa.Schema) -> dict[str, str]:
    """``schema``'s metadata as text (keys and values are UTF-8 bytes in Arrow)."""
    return {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
