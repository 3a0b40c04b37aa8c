"""Stream input rows from JSON Lines or Parquet (the pass-through fields: :mod:`batchgen.io.passthrough`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import BatchgenError, RowError
from batchgen.io.openai_batch import OpenAIBatchInput, is_openai_batch_line
from batchgen.io.passthrough import JSON_TEXT_METADATA, KNOWN_FIELDS, infer_schema, json_type_name, passthrough_names

_JSONL_SUFFIXES = (".jsonl", ".json")
_PARQUET_SUFFIXES = (".parquet",)


@dataclass(frozen=True)
class InputRow:
    """One input row, as read from the file.

    Attributes:
        index: 0-based row index in the dataset (the default ``id``); blank JSONL lines get none.
        line: 1-based line number (JSONL, blank lines counted) or 1-based row number (Parquet).
        data: the row's fields with their original names. Parquet nulls are left out, so a null and an
            absent field mean the same thing ("not set"). An OpenAI Batch line's are those of its batchgen row.
        error: why the row is bad, when the reader knows it already (an OpenAI Batch line asking for what batchgen
            cannot do): :func:`batchgen.io.rows.parse_row` raises it.
    """

    index: int
    line: int
    data: dict[str, Any]
    error: RowError | None = None


class RowReader:
    """Stream the rows of a ``.jsonl``/``.json`` (JSON Lines) or ``.parquet`` file, one block at a time.

    Iterating yields :class:`InputRow` for each row and :class:`RowError` (yielded, not raised) for each
    JSONL line that is not a JSON object; such lines still use up a row index, so later default ids do not
    shift. The reader can be iterated more than once; each pass re-reads the file.

    ``passthrough_schema`` is known as soon as the constructor returns: it holds every input field that is
    not a known field (``id``, the prompt and sampling fields and their aliases), all nullable, under the names
    ``passthrough_names`` gives them (a field named like an output column, ``text`` or ``error``, is renamed
    ``input_<name>``; see :func:`passthrough_names`), as in :func:`batchgen.io.rows.parse_row`'s result. For
    Parquet the types come from the file schema. For JSONL they are inferred by pyarrow from the first
    ``block_rows`` rows (read ahead and buffered here), in order of first appearance; a null type (a field null
    in all of them, or only empty lists) becomes ``string`` (``list<string>``). When values disagree the first
    one's type wins, and rows that do not fit it fail in ``parse_row``.

    Args:
        path: the input file; ``str(path)`` is used as the source name in every message.
        block_rows: rows per read block, and the number of JSONL rows used to infer the schema.

    Raises:
        BatchgenError: the file is missing, a directory, unreadable, not valid Parquet, has an unsupported
            extension, has no rows, or (JSONL) looks like a JSON document instead of JSON Lines.
        ValueError: ``block_rows`` < 1.
    """

    source: str
    passthrough_schema: pa.Schema
    passthrough_names: dict[str, str]  # pass-through field → its column (:func:`passthrough_names`)
    openai: OpenAIBatchInput | None = None  # set for an OpenAI Batch file (:mod:`batchgen.io.openai_batch`)

    def __init__(self, path: Path, block_rows: int = 1024) -> None:
        if block_rows < 1:
            raise ValueError(f"block_rows must be >= 1, got {block_rows}")
        self.path = Path(path)
        self.source = str(path)
        self.block_rows = block_rows
        _check_readable_file(self.path, self.source)
        suffix = self.path.suffix.lower()
        if suffix in _JSONL_SUFFIXES:
            self._format = "jsonl"
            self._init_jsonl()
        elif suffix in _PARQUET_SUFFIXES:
            self._format = "parquet"
            self._init_parquet()
        else:
            raise BatchgenError(f"{self.source}: unsupported input format '{suffix}' (use .jsonl or .parquet)")

    def __iter__(self) -> Iterator[InputRow | RowError]:
        if self._format == "jsonl":
            yield from self._iter_jsonl()
        else:
            yield from self._iter_parquet()

    # --- JSON Lines -------------------------------------------------------------------------------------
    # stdlib json, not pyarrow.json: we need an exact error per line and must accept rows of differing
    # shapes, neither of which pyarrow's block-based JSON reader can give.

    def _init_jsonl(self) -> None:
        self._kind_known = False  # whether the first JSON object has said if this is an OpenAI Batch file
        self._head: list[InputRow | RowError] = []
        self._head_end = 0  # byte offset just after the read-ahead block
        self._head_lines = 0
        first_text: str | None = None
        with self._open_jsonl() as f:
            while len(self._head) < self.block_rows:
                raw = f.readline()
                if not raw:
                    break
                self._head_lines += 1
                item = self._parse_line(raw, self._head_lines, len(self._head))
                if item is None:
                    continue
                if first_text is None:
                    first_text = raw.decode("utf-8", "replace").strip()
                    _reject_json_document(item, first_text, self.source)
                self._head.append(item)
            self._head_end = f.tell()
        if not self._head:
            raise BatchgenError(f"{self.source}: dataset is empty")
        rows = [r.data for r in self._head if isinstance(r, InputRow)]
        self.passthrough_names = passthrough_names(key for row in rows for key in row)
        self.passthrough_schema = infer_schema(rows, self.passthrough_names)

    def _open_jsonl(self) -> BinaryIO:
        # Binary mode: tell() works between readline() calls, and a bad byte is one row's error, not a crash.
        try:
            return self.path.open("rb")
        except OSError as e:
            raise BatchgenError(f"{self.source}: cannot read: {e.strerror or e}") from None

    def _iter_jsonl(self) -> Iterator[InputRow | RowError]:
        yield from self._head
        line, index = self._head_lines, len(self._head)
        with self._open_jsonl() as f:
            f.seek(self._head_end)
            for raw in f:
                line += 1
                item = self._parse_line(raw, line, index)
                if item is not None:
                    index += 1
                    yield item

    def _parse_line(self, raw: bytes, line: int, index: int) -> InputRow | RowError | None:
        """Decode one JSONL line; ``None`` for a blank line."""
        try:
            text = raw.decode("utf-8-sig" if line == 1 else "utf-8")
        except UnicodeDecodeError as e:
            return RowError(self.source, line, None, f"invalid UTF-8 at byte {e.start + 1}")
        if _blank(text):
            return None
        try:
            # Without its line end, so that an error at the end of the line points there, not to a column 1 after.
            value = json.loads(text.rstrip("\r\n"))
        except json.JSONDecodeError as e:
            return RowError(self.source, line, None, f"invalid JSON: {e.msg} (column {e.colno})")
        except RecursionError:
            return RowError(self.source, line, None, "invalid JSON: nested too deeply")
        if not isinstance(value, dict):
            return RowError(self.source, line, None, f"expected a JSON object, got {json_type_name(value)}")
        return self._openai_row(InputRow(index=index, line=line, data=value))

    def _openai_row(self, row: InputRow) -> InputRow:
        """``row`` as batchgen reads it: unchanged, or an OpenAI Batch line mapped onto batchgen's fields.

        Raises:
            BatchgenError: a file mixing OpenAI Batch lines with batchgen rows.
        """
        if not self._kind_known:
            self._kind_known = True
            if is_openai_batch_line(row.data):
                self.openai = OpenAIBatchInput(self.source)
        if self.openai is None:
            if is_openai_batch_line(row.data):
                raise BatchgenError(
                    f"{self.source}:{row.line}: an OpenAI Batch request line, but the file's first row is not one; "
                    "a file holds one kind of row"
                )
            return row
        data, error = self.openai.row(row.data, row.line)
        return InputRow(index=row.index, line=row.line, data=data, error=error)

    # --- Parquet ----------------------------------------------------------------------------------------

    def _init_parquet(self) -> None:
        with self._open_parquet() as pf:
            schema = pf.schema_arrow
            num_rows = pf.metadata.num_rows
        if num_rows == 0:
            raise BatchgenError(f"{self.source}: dataset is empty")
        repeated = sorted({n for n in schema.names if schema.names.count(n) > 1})
        if repeated:
            raise BatchgenError(f"{self.source}: column '{repeated[0]}' appears more than once; rename all but one")
        self.passthrough_names = passthrough_names(schema.names)
        fields: dict[str, pa.Field] = {}
        for field in schema:
            if field.name in KNOWN_FIELDS:
                continue
            name = self.passthrough_names[field.name]
            # Nullable: rows that fail still get an output row, with nulls for their pass-through fields. A
            # column of an earlier output marked JSON text is plain text here: its values are not encoded again.
            metadata = {k: v for k, v in (field.metadata or {}).items() if k not in JSON_TEXT_METADATA}
            fields[name] = field.with_name(name).with_nullable(True).with_metadata(metadata)
        self.passthrough_schema = pa.schema(list(fields.values()))

    def _open_parquet(self) -> pq.ParquetFile:
        try:
            return pq.ParquetFile(self.path)
        except OSError as e:
            raise BatchgenError(f"{self.source}: cannot read: {e.strerror or e}") from None
        except pa.ArrowException as e:
            raise BatchgenError(f"{self.source}: not a valid Parquet file ({e})") from None

    def _iter_parquet(self) -> Iterator[InputRow | RowError]:
        index = 0
        with self._open_parquet() as pf:
            for batch in pf.iter_batches(batch_size=self.block_rows):
                for row in batch.to_pylist():
                    data = {k: v for k, v in row.items() if v is not None}
                    yield InputRow(index=index, line=index + 1, data=data)
                    index += 1


def _check_readable_file(path: Path, source: str) -> None:
    try:
        if path.is_dir():
            raise BatchgenError(f"{source}: is a directory, expected an input file")
        if not path.exists():
            raise BatchgenError(f"{source}: no such file")
    except OSError as e:
        raise BatchgenError(f"{source}: cannot read: {e.strerror or e}") from None


def _reject_json_document(first: InputRow | RowError, text: str, source: str) -> None:
    """Fail fast on a pretty-printed JSON file, which would otherwise give one row error per line."""
    if isinstance(first, RowError) and (text.startswith("[") or text == "{"):
        raise BatchgenError(
            f"{source}:{first.line}: not a JSON object; this looks like a JSON document, "
            "but batchgen reads JSON Lines (one object per line)"
        )


def _blank(text: str) -> bool:
    """A JSONL line with nothing but whitespace (Unicode's too): skipped, not a row."""
    return not text.strip()


def count_input_rows(path: Path) -> int:
    """Rows in the dataset (non-blank JSONL lines; Parquet metadata), streaming, for progress and status.

    Raises:
        BatchgenError: the file cannot be read.
    """
    try:
        if path.suffix.lower() in _PARQUET_SUFFIXES:
            return int(pq.ParquetFile(path).metadata.num_rows)
        with open(path, "rb") as f:
            # Blank as the reader sees it (Unicode whitespace too), so that status and --resume count its rows.
            return sum(not _blank(raw.decode("utf-8-sig" if i == 0 else "utf-8", "replace")) for i, raw in enumerate(f))
    except (OSError, pa.ArrowException) as e:
        raise BatchgenError(f"{path}: cannot read: {e}") from None
