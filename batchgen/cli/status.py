"""``batchgen status``: how far a run has got."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import typer

from batchgen.cli import release_startup_interrupts
from batchgen.cli.user_errors import user_errors
from batchgen.errors import BatchgenError


def status(
    dataset: Path | None = typer.Argument(None, metavar="[DATASET]", help="The dataset the run reads."),
    out: Path | None = typer.Argument(None, metavar="[OUT]", help="The run's --out."),
    config: Path | None = typer.Option(
        None,
        help="The run's --config file: its dataset and out keys where not given, and its settings, compared with "
        "those a finished OUT records as --resume compares them.",
    ),
) -> None:
    """Show how far the run from DATASET to OUT has got: rows done, remaining and errored. Exit status 0 when OUT is
    a finished output with a row for every row of DATASET (and, with --config, made with its settings), 1 when rows
    remain or it was made otherwise (not started, in progress, finished with rows missing or changed since, or with
    other settings), 2 when DATASET, OUT or the config cannot be read."""
    from batchgen.api.config_file import with_config
    from batchgen.api.options import options_of
    from batchgen.io.input_options import InputOptions
    from batchgen.job.options import JobOptions
    from batchgen.job.status import read_output_status
    from batchgen.loop.options import EngineOptions
    from batchgen.sampling.sampling_params import SamplingParams

    release_startup_interrupts()
    with user_errors():
        try:
            values = with_config(config, {"dataset": dataset, "out": out})
            dataset, out = values.pop("dataset", None), values.pop("out", None)
            if dataset is None or out is None:
                raise BatchgenError("status needs DATASET and OUT, as arguments or as the keys of its --config")
            if config is None:
                found = read_output_status(Path(dataset), Path(out))
            else:
                settings = options_of(EngineOptions, values), options_of(SamplingParams, values)
                columns, force = options_of(InputOptions, values), options_of(JobOptions, values).resume_force
                found = read_output_status(Path(dataset), Path(out), columns, settings, force)
        except KeyboardInterrupt:  # Typer would end it with no word; status only reads, nothing to flush
            print("batchgen: interrupted", file=sys.stderr)
            raise typer.Exit(128 + signal.SIGINT) from None
    print("\n".join(found.lines()))
    if not found.complete:  # a scheduler's test, as `diff` answers 0 same, 1 different, 2 trouble
        raise typer.Exit(1)
