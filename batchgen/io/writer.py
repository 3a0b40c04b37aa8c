"""Write result rows incrementally as Arrow IPC, Parquet or JSON Lines, and read them back."""

from __future__ import annotations

import base64
import json
import math
from abc import ABC, abstractmethod
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import BatchgenError
from batchgen.io.json_text import JSON_TEXT_METADATA, is_json_text
from batchgen.io.output_format import IPC_SUFFIXES, check_output_format

_TOKEN_LOGPROB = pa.struct([pa.field("id", pa.int32()), pa.field("logprob", pa.float32())])

# The columns batchgen produces, in output order; pass-through input fields follow them.
OUTPUT_COLUMNS: pa.Schema = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field("sample_index", pa.int32()),
        pa.field("text", pa.string()),
        pa.field("output_token_ids", pa.list_(pa.int32())),
        pa.field("output_logprobs", pa.list_(pa.float32())),
        pa.field("top_logprobs", pa.list_(pa.list_(_TOKEN_LOGPROB))),
        pa.field("finish_reason", pa.string()),
        pa.field("matched_stop", pa.string()),
        pa.field("error", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("prompt_logprobs", pa.list_(pa.float32())),
        pa.field("prompt_logprob_sum", pa.float64()),
        pa.field("prompt_is_greedy", pa.bool_()),
        pa.field("prompt_top_logprobs", pa.list_(pa.list_(_TOKEN_LOGPROB))),
        pa.field("spec_accept_length", pa.float32()),
    ]
)


def result_schema(passthrough: pa.Schema, metadata: dict[str, str]) -> pa.Schema:
    """Return the output schema: :data:`OUTPUT_COLUMNS`, then ``passthrough``'s fields, with ``metadata``.

    Raises:
        ValueError: a pass-through field has the name of an output column (the reader renames those).
    """
    clash = set(passthrough.names) & set(OUTPUT_COLUMNS.names)
    if clash:
        raise ValueError(f"pass-through fields collide with output columns: {sorted(clash)}")
    return pa.schema([*OUTPUT_COLUMNS, *passthrough], metadata=metadata)


class ResultWriter(ABC):
    """Appends result rows to one output file; usable as a context manager.

    Each :meth:`write` hands its rows to the operating system before returning, so they survive the
    process dying later. JSONL is readable line by line at any time; Arrow IPC files and Parquet files
    are only readable after :meth:`close`, which writes their footer.
    """

    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self.path = path
        self.schema = schema
        self.closed = False

    def write(self, rows: list[dict[str, Any]]) -> None:
        """Append ``rows`` (dicts keyed by column name; missing keys are null) and flush them.

        ``top_logprobs`` is ``list[list[tuple[int, float]]] | None`` (``(token id, logprob)`` pairs);
        ``output_logprobs`` may be ``None``. An empty ``rows`` writes nothing.

        Raises:
            ValueError: the writer is closed, or a row has a key that is not a column.
            pyarrow.ArrowInvalid, pyarrow.ArrowTypeError, OverflowError: a value does not fit its column.
            OSError: the file system failed.
        """
        if self.closed:
            raise ValueError(f"{self.path}: writer is closed")
        if not rows:
            return
        names = set(self.schema.names)
        for row in rows:
            extra = row.keys() - names
            if extra:
                raise ValueError(f"row has keys that are not output columns: {sorted(extra)}")
        self._write(pa.RecordBatch.from_pylist(rows, schema=self.schema))

    def write_batch(self, batch: pa.RecordBatch) -> None:
        """Append a batch whose columns are this writer's (metadata may differ), and flush it.

        Raises:
            ValueError: the writer is closed, or the batch's columns are not this writer's.
            OSError: the file system failed.
        """
        if self.closed:
            raise ValueError(f"{self.path}: writer is closed")
        if not batch.schema.equals(self.schema, check_metadata=False):
            raise ValueError(f"{self.path}: batch columns differ from the output's")
        if batch.num_rows:
            # Re-attached to our schema so that the file carries this writer's metadata, not the batch's.
            self._write(pa.RecordBatch.from_arrays(batch.columns, schema=self.schema))

    def close(self) -> None:
        """Finish the file (footer for IPC and Parquet) and release it; calling it again does nothing."""
        if not self.closed:
            self.closed = True
            self._close()

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @abstractmethod
    def _write(self, batch: pa.RecordBatch) -> None: ...

    @abstractmethod
    def _close(self) -> None: ...


class _SinkWriter(ResultWriter):
    """A writer over a ``pa.OSFile`` sink whose footer is written when the writer closes."""

    _sink: pa.OSFile
    _writer: Any

    def _close(self) -> None:
        try:
            self._writer.close()
        finally:
            self._sink.close()


class _IpcWriter(_SinkWriter):
    def __init__(self, path: Path, schema: pa.Schema) -> None:
        super().__init__(path, schema)
        # OSFile is unbuffered, so write_batch reaches the OS; the explicit flush keeps that true if it changes.
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_file(self._sink, schema)

    def _write(self, batch: pa.RecordBatch) -> None:
        self._writer.write_batch(batch)
        self._sink.flush()


class _ParquetWriter(_SinkWriter):
    def __init__(self, path: Path, schema: pa.Schema) -> None:
        super().__init__(path, schema)
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pq.ParquetWriter(self._sink, schema)

    def _write(self, batch: pa.RecordBatch) -> None:
        # One row group per write: write_table would split large writes at its default row group size.
        self._writer.write_table(pa.Table.from_batches([batch]), row_group_size=batch.num_rows)
        self._sink.flush()


class _JsonlWriter(ResultWriter):
    def __init__(self, path: Path, schema: pa.Schema) -> None:
        super().__init__(path, schema)
        self._file: TextIO = path.open("w", encoding="utf-8")
        # JSON holds values of any type side by side: these columns' values are written as they were read, not as
        # the text Arrow holds them in (found by a helper: a boolean came back as the string "true").
        self._json_text = [field.name for field in schema if is_json_text(field)]

    def _write(self, batch: pa.RecordBatch) -> None:
        # Going through Arrow gives JSONL the same type checks and struct-to-object conversion as the other formats.
        rows = batch.to_pylist()
        for row in rows if self._json_text else ():
            for name in self._json_text:
                if row[name] is not None:
                    row[name] = json.loads(row[name])
        lines = [json_line(row) for row in rows]
        self._file.write("".join(lines))
        self._file.flush()

    def _close(self) -> None:
        self._file.close()


def json_line(row: dict[str, Any]) -> str:
    """One row as a strict JSON line: JSON has no NaN or infinity, so such floats (from pass-through fields) are
    written as null."""
    try:
        return json.dumps(row, ensure_ascii=False, default=_json_default, allow_nan=False) + "\n"
    except ValueError:  # the rare row holding a NaN or an infinity: only it pays for the walk
        return json.dumps(_finite_or_null(row), ensure_ascii=False, default=_json_default, allow_nan=False) + "\n"


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(item) for item in value]
    return value


def _json_default(value: Any) -> Any:
    """Encode the Python values pyarrow returns for non-JSON Arrow types (Parquet pass-through columns)."""
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode("ascii")
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def open_result_writer(path: Path, passthrough: pa.Schema, metadata: dict[str, str]) -> ResultWriter:
    """Create (or truncate) the output file ``path`` and return a writer for it.

    The format follows the extension: ``.arrow``/``.ipc``/``.feather`` → Arrow IPC file format, ``.parquet``
    → Parquet (one row group per write), ``.jsonl`` → JSON Lines. ``metadata`` goes into the Arrow/Parquet
    schema metadata and is not written to JSONL. The parent directory must exist.

    Raises:
        BatchgenError: unsupported extension, missing parent directory, or the file cannot be created.
    """
    suffix = check_output_format(path)
    parent = path.parent
    if not parent.is_dir():
        raise BatchgenError(f"{path}: output directory '{parent}' does not exist")
    if path.is_dir():
        raise BatchgenError(f"{path}: is a directory, expected an output file")
    schema = result_schema(passthrough, metadata)
    try:
        if suffix in IPC_SUFFIXES:
            return _IpcWriter(path, schema)
        if suffix == ".parquet":
            return _ParquetWriter(path, schema)
        return _JsonlWriter(path, schema)
    except OSError as e:
        raise BatchgenError(f"{path}: cannot create output file: {e.strerror or e}") from None


def read_results(path: Path) -> pa.Table:
    """Read a finished output file of any supported format into a table.

    For JSONL the output columns get their :data:`OUTPUT_COLUMNS` types and other columns are inferred by pyarrow, or
    are JSON text where their values share no one type (as batchgen types its input's); a zero-row JSONL file gives
    an empty table with just the output columns.

    Raises:
        BatchgenError: unsupported extension, or the file cannot be read or parsed (e.g. an Arrow IPC
            file whose writer never closed it).
    """
    suffix = check_output_format(path)
    try:
        if suffix in IPC_SUFFIXES:
            with pa.OSFile(str(path), "rb") as source, pa.ipc.open_file(source) as reader:
                return reader.read_all()
        if suffix == ".parquet":
            return pq.read_table(path)
        return _read_jsonl(path)
    except (OSError, pa.ArrowException, ValueError, OverflowError) as e:
        raise BatchgenError(f"{path}: cannot read results ({e})") from None


def _read_jsonl(path: Path) -> pa.Table:
    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        return OUTPUT_COLUMNS.empty_table()
    fields, arrays = [], []
    for name in dict.fromkeys(key for row in rows for key in row):
        values = [row.get(name) for row in rows]
        field = OUTPUT_COLUMNS.field(name) if name in OUTPUT_COLUMNS.names else None
        try:
            array = pa.array(values, type=None if field is None else field.type)
        except (pa.ArrowException, TypeError, OverflowError):  # overflow: an integer beyond 64 bits
            if field is not None:
                raise
            field = pa.field(name, pa.string(), metadata=JSON_TEXT_METADATA)
            array = pa.array([None if v is None else json.dumps(v, ensure_ascii=False) for v in values], pa.string())
        fields.append(field or pa.field(name, array.type))
        arrays.append(array)
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))
