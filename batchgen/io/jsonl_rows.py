"""Decode JSON Lines shards line by line.

stdlib json, not pyarrow.json: we need an exact error per line and must accept rows of differing shapes, neither of
which pyarrow's block-based JSON reader can give.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from batchgen.errors import BatchgenError, RowError
from batchgen.io.input_row import InputRow
from batchgen.io.passthrough import json_type_name

# Files a JSONL name can hide, by the bytes they start with (an Arrow IPC stream: its continuation marker).
_OTHER_FORMATS = {b"PAR1": "a Parquet file: name it .parquet", b"ARROW1": "an Arrow IPC file: name it .arrow",
                  b"\xff\xff\xff\xff": "an Arrow IPC stream: name it .arrow",
                  b"\x1f\x8b": "gzip-compressed: decompress it first"}  # fmt: skip


def open_jsonl(path: Path) -> BinaryIO:
    """Open a JSONL shard in binary mode: a bad byte is one row's error, not a crash.

    Raises:
        BatchgenError: the file cannot be read.
    """
    try:
        return path.open("rb")
    except OSError as e:
        raise BatchgenError(f"{path}: cannot read: {e.strerror or e}") from None


def jsonl_rows(path: Path, source: str, index: int) -> Iterator[InputRow | RowError]:
    """The rows of the JSONL shard ``path``, the first one with row index ``index``.

    Raises:
        BatchgenError: :func:`open_jsonl`'s and :func:`parse_line`'s errors; the shard's first line that is not
            blank looks like a pretty-printed JSON document (:func:`reject_json_document`).
    """
    first = True
    with open_jsonl(path) as f:
        for line, raw in enumerate(f, start=1):
            item = parse_line(raw, line, index, source)
            if item is None:
                continue
            if first:
                first = False
                reject_json_document(item, raw, source)
            index += 1
            yield item


def parse_line(raw: bytes, line: int, index: int, source: str) -> InputRow | RowError | None:
    """Decode one JSONL line; ``None`` for a blank line.

    Raises:
        BatchgenError: the first line of a shard starts as a Parquet, Arrow or gzip file does (every line would
            otherwise be a row error).
    """
    if line == 1 and (kind := next((kind for magic, kind in _OTHER_FORMATS.items() if raw.startswith(magic)), None)):
        raise BatchgenError(f"{source}: not JSON Lines; this is {kind}")
    try:
        text = raw.decode("utf-8-sig" if line == 1 else "utf-8")
    except UnicodeDecodeError as e:
        return RowError(source, line, None, f"invalid UTF-8 at byte {e.start + 1}")
    if blank(text):
        return None
    try:
        # Without its line end, so that an error at the end of the line points there, not to a column 1 after.
        value = json.loads(text.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        return RowError(source, line, None, f"invalid JSON: {e.msg} (column {e.colno})")
    except RecursionError:
        return RowError(source, line, None, "invalid JSON: nested too deeply")
    if not isinstance(value, dict):
        return RowError(source, line, None, f"expected a JSON object, got {json_type_name(value)}")
    return InputRow(index=index, line=line, data=value, source=source)


def reject_json_document(first: InputRow | RowError, raw: bytes, source: str) -> None:
    """Fail fast on a pretty-printed JSON file (its first row ``first`` read from the line ``raw``), which would
    otherwise give one row error per line.

    Raises:
        BatchgenError: saying so.
    """
    text = raw.decode("utf-8", "replace").strip()
    if isinstance(first, RowError) and (text.startswith("[") or text == "{"):
        raise BatchgenError(
            f"{source}:{first.line}: not a JSON object; this looks like a JSON document, "
            "but batchgen reads JSON Lines (one object per line)"
        )


def blank(text: str) -> bool:
    """A JSONL line with nothing but whitespace (Unicode's too): skipped, not a row."""
    return not text.strip()


def count_jsonl_rows(path: Path) -> int:
    """Non-blank lines of a JSONL shard, as the reader counts rows (Unicode whitespace is blank too), streaming.

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        return sum(not blank(raw.decode("utf-8-sig" if i == 0 else "utf-8", "replace")) for i, raw in enumerate(f))
