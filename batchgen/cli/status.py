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
    """Show how far the run from DATASET to OUT has got: rows done, remaining and errored."""
    from batchgen.job.status import output_status

    release_startup_interrupts()
    with user_errors():
        try:
            for line in output_status(dataset, out):
                print(line)
        except KeyboardInterrupt:  # Typer would end it with no word; status only reads, nothing to flush
            print("batchgen: interrupted", file=sys.stderr)
            raise typer.Exit(128 + signal.SIGINT) from None
