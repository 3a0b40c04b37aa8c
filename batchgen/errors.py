"""User-facing errors: each prints as one line and makes the CLI exit with code 2 (3: bad rows left out), no
traceback."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.job.summary import RunSummary

_SHOWN_LIMIT = 80


def shown_value(value: Any) -> str:
    """A value from an input row as an error message shows it: written as JSON (``true``, ``null``, ``"a"``), as
    the user wrote it, cut to 80 characters; values JSON cannot write (Parquet dates, bytes) as Python shows them."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _SHOWN_LIMIT else text[: _SHOWN_LIMIT - 3] + "..."


class BatchgenError(Exception):
    """A mistake in the user's input, options or environment (not a bug in batchgen).

    The CLI prints ``str(error)`` as one line on stderr and exits with code :attr:`exit_status`.
    """

    exit_status = 2


class BadRowsLeftOut(BatchgenError):
    """A run under ``--on-error fail`` left bad input rows out after writing the good ones: exit status 3, so that a
    scheduler tells "fix these rows, then ``--resume``" from a job that could not run (2). ``summary`` is the run's
    :class:`~batchgen.job.summary.RunSummary` (rows written, ``errors`` the bad rows)."""

    exit_status = 3

    def __init__(self, message: str, summary: RunSummary) -> None:
        super().__init__(message)
        self.summary = summary

    def __reduce__(self) -> tuple[type[BadRowsLeftOut], tuple[str, RunSummary]]:
        # Rebuilt from its parts: args holds only the message.
        return type(self), (str(self), self.summary)


class OutputError(BatchgenError):
    """The partial output cannot take this run's rows (a write failed, another run changed it), and the message says
    how to go on (``--resume``), so the run adds no word of its own about the rows kept."""


class RowError(BatchgenError):
    """One input row is invalid.

    Args:
        source: the input file name, as the user gave it.
        line: 1-based line number (JSONL) or 1-based row number (Parquet).
        field: the offending field, or ``None`` when the whole row is wrong (e.g. bad JSON).
        message: what is wrong, in a few words.
    """

    def __init__(self, source: str, line: int, field: str | None, message: str) -> None:
        self.source = source
        self.line = line
        self.field = field
        self.message = message
        where = f"{source}:{line}"
        super().__init__(f"{where}: field '{field}': {message}" if field else f"{where}: {message}")

    def __reduce__(self) -> tuple[type[RowError], tuple[str, int, str | None, str]]:
        # Rebuilt from its parts (a Ray replica's error reaches the driver pickled): args holds only the message.
        return type(self), (self.source, self.line, self.field, self.message)

    def named(self, columns: dict[str, str]) -> RowError:
        """This error with its field named as the input named it: ``columns`` maps a field batchgen read to that
        name (a ``--id-column``'s column, an OpenAI request's ``body.max_tokens``); itself when it has none."""
        name = columns.get(self.field or "")
        return self if name is None else RowError(self.source, self.line, name, self.message)


class FieldError(ValueError):
    """A value of one named field is invalid; callers turn it into a :class:`RowError` or a CLI error."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"field '{field}': {message}")


# The row error for text that is_unicode_text refuses.
NOT_UNICODE = "holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text"


def is_unicode_text(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8: no lone surrogate (\\ud800-\\udfff), which JSON input may hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun`` in the number it takes: ``1 row``, ``2 rows`` (``noun`` is the singular; plurals in s)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def one_line(error: BaseException) -> str:
    """An exception's message as one line: its non-blank lines joined by spaces (its type name if it has none), so
    that a library's message that lists its reasons over several lines (transformers' "Couldn't instantiate the
    backend tokenizer from one of: ...") keeps them."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__


def caller_stacklevel() -> int:
    """The ``stacklevel`` at which a warning raised by this function's caller points at the first frame outside the
    batchgen package: the user's line that called batchgen (Python 3.12's ``skip_file_prefixes``, on every
    version)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level
