"""The output formats batchgen writes, told by the output's extension, and what each can store."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import BatchgenError, one_line

IPC_SUFFIXES = (".arrow", ".ipc", ".feather")
_SUPPORTED = ".arrow, .ipc, .feather, .parquet or .jsonl"


def check_output_format(path: Path) -> str:
    """Return the output's lower-case extension.

    Raises:
        BatchgenError: batchgen cannot write that format.
    """
    suffix = path.suffix.lower()
    if suffix not in (*IPC_SUFFIXES, ".parquet", ".jsonl"):
        raise BatchgenError(f"{path}: unsupported output format '{suffix}' (use {_SUPPORTED})")
    return suffix


def check_output_columns(path: Path, passthrough: pa.Schema) -> None:
    """Refuse, before a run starts, a pass-through column that the output's format cannot store and read back
    (Parquet has no interval type, no struct of no fields, and reads no column nested past 100 levels, a list being
    2); found by a helper: refused only when the finished rows were assembled, so that every ``--resume`` failed
    again.

    Raises:
        BatchgenError: naming the column, its type and the formats that take it.
    """
    if check_output_format(path) != ".parquet":
        return
    for field in passthrough:
        try:
            sink = pa.BufferOutputStream()
            pq.ParquetWriter(sink, pa.schema([field])).close()
            pq.read_schema(pa.BufferReader(sink.getvalue()))  # its reader refuses nesting past 100 levels (a review)
        except (pa.ArrowException, OSError) as e:
            raise BatchgenError(
                f"{path}: Parquet cannot store the column '{field.name}' ({field.type}: {one_line(e)}); "
                "write a .arrow or .jsonl output instead"
            ) from None
