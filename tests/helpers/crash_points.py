"""Test helper: make a ``batchgen run`` process die, as ``kill -9`` would, at an exact point of its work.

:func:`install` wraps batchgen's own functions in the process it is called in (a run forked by fork_runner.py,
before it starts ``batchgen``), so the product carries no hooks. The process ends with ``os._exit(137)``: no
``finally`` block, no flush, no cleanup runs, as after a SIGKILL.

- ``(AFTER_ROWS, N)``: it dies once it has finished N rows (all of a row's samples, counted one per
  ``RunJob._finish``) since it started, right after the N-th one is handed over to the pending part.
- ``(IN_FLUSH, N)``: it dies while writing its N-th part file, with the first half of the part's bytes in the
  temporary file (``part-NNNNNN.tmp``), as a kill in the middle of the write leaves it.

:func:`part_write_with_fault` is the part writer with a fault at its N-th call; tests that run ``batchgen`` in
their own process install it with ``monkeypatch`` (a full disk, a bug), and ``IN_FLUSH`` is built on it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
from tqdm import tqdm

from batchgen.io import partial_output
from batchgen.job.rounds import RowResults
from batchgen.job.run_job import RunJob

AFTER_ROWS = "after_rows"
IN_FLUSH = "in_flush"
# Where and after how many events (rows, or part writes) a run dies.
CrashPoint = tuple[str, int]
KILLED = 137  # the exit code a shell reports for a process killed by SIGKILL (128 + 9)


def install(point: CrashPoint) -> None:
    """Make this process die at ``point``; the first event counted is the first one after this call.

    Raises:
        ValueError: an unknown kind of point, or a count below 1.
    """
    kind, count = point
    if count < 1:
        raise ValueError(f"crash point {point}: the count must be at least 1")
    if kind == AFTER_ROWS:
        _die_after_rows(count)
    elif kind == IN_FLUSH:
        _die_in_flush(count)
    else:
        raise ValueError(f"crash point {point}: the kind is {AFTER_ROWS!r} or {IN_FLUSH!r}")


def _die_after_rows(count: int) -> None:
    finish = RunJob._finish
    finished = 0

    def finish_then_maybe_die(self: RunJob, results: RowResults, bar: tqdm) -> None:
        nonlocal finished
        finish(self, results, bar)
        finished += 1
        if finished == count:
            os._exit(KILLED)

    RunJob._finish = finish_then_maybe_die  # type: ignore[method-assign]


PartWriter = Callable[[Path, pa.Buffer], None]


def part_write_with_fault(at: int, fault: Callable[[PartWriter, Path, pa.Buffer], None]) -> PartWriter:
    """``partial_output.write_part_file`` as it is now, except that its ``at``-th call (counting from 1) runs
    ``fault(write_part_file, path, data)`` instead: raise as a full disk does, write some of the bytes, die."""
    write = partial_output.write_part_file
    calls = 0

    def write_or_fault(path: Path, data: pa.Buffer) -> None:
        nonlocal calls
        calls += 1
        if calls == at:
            fault(write, path, data)
        else:
            write(path, data)

    return write_or_fault


def _write_half_and_die(write: PartWriter, path: Path, data: pa.Buffer) -> None:
    write(path, data.slice(0, data.size // 2))
    os._exit(KILLED)


def _die_in_flush(count: int) -> None:
    partial_output.write_part_file = part_write_with_fault(count, _write_half_and_die)  # type: ignore[assignment]
