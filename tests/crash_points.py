"""Test helper: make a ``batchgen run`` process die, as ``kill -9`` would, at an exact point of its work.

:func:`install` wraps batchgen's own functions in the process it is called in (a run forked by fork_runner.py,
before it starts ``batchgen``), so the product carries no hooks. The process ends with ``os._exit(137)``: no
``finally`` block, no flush, no cleanup runs, as after a SIGKILL.

- ``(AFTER_ROWS, N)``: it dies once it has finished N rows (samples, counted one per ``RunJob._finish``) since
  it started, right after the N-th one is handed over to the pending part.
- ``(IN_FLUSH, N)``: it dies while writing its N-th part file, with the first half of the part's bytes in the
  temporary file (``part-NNNNNN.tmp``), as a kill in the middle of the write leaves it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
from tqdm import tqdm

from batchgen.io import partial_output
from batchgen.job.run_job import RunJob
from batchgen.loop.req import Req

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

    def finish_then_maybe_die(self: RunJob, req: Req, bar: tqdm) -> None:
        nonlocal finished
        finish(self, req, bar)
        finished += 1
        if finished == count:
            os._exit(KILLED)

    RunJob._finish = finish_then_maybe_die  # type: ignore[method-assign]


def _die_in_flush(count: int) -> None:
    write = partial_output.write_part_file
    writes = 0

    def write_or_die_half_way(path: Path, data: pa.Buffer) -> None:
        nonlocal writes
        writes += 1
        if writes == count:
            write(path, data.slice(0, data.size // 2))
            os._exit(KILLED)
        write(path, data)

    partial_output.write_part_file = write_or_die_half_way
