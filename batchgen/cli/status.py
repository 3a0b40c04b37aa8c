"""``batchgen status``: how far a run has got."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import typer

from batchgen.cli import release_startup_interrupts
from batchgen.cli.user_errors import user_errors


def status(
    dataset: Path = typer.Argument(..., metavar="DATASET", help="The dataset the run reads."),
    out: Path = typer.Argument(..., metavar="OUT", help="The run's --out."),
) -> None:
    """Show how far the run from DATASET to OUT has got: rows done, remaining and errored. Exit status 0 when OUT is
    a finished output with a row for every row of DATASET, 1 when rows remain (not started, in progress, finished
    with rows missing), 2 when DATASET or OUT cannot be read."""
    from batchgen.job.status import read_output_status

    release_startup_interrupts()
    with user_errors():
        try:
            found = read_output_status(dataset, out)
        except KeyboardInterrupt:  # Typer would end it with no word; status only reads, nothing to flush
            print("batchgen: interrupted", file=sys.stderr)
            raise typer.Exit(128 + signal.SIGINT) from None
    print("\n".join(found.lines()))
    if not found.complete:  # a scheduler's test, as `diff` answers 0 same, 1 different, 2 trouble
        raise typer.Exit(1)
