"""How CLI commands report user mistakes: one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from batchgen.errors import BatchgenError


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn a :class:`BatchgenError` into one line on stderr and exit code 2."""
    try:
        yield
    except BatchgenError as e:
        print(f"batchgen: error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
