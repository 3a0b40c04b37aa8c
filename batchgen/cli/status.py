"""``batchgen status``: how far a run has got."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import typer

from batchgen.api.config_file import OPTION_HINTS
from batchgen.cli.config import load_config
from batchgen.cli.options import with_options
from batchgen.cli.user_errors import given, user_errors
from batchgen.errors import BatchgenError
from batchgen.io.input_options import InputOptions
from batchgen.job.options import JobOptions
from batchgen.loop.options import EngineOptions
from batchgen.sampling.sampling_params import SamplingParams


@with_options(hidden=True)
def status(
    ctx: typer.Context,
    dataset: Path | None = typer.Argument(None, metavar="[DATASET]", help="The dataset the run reads."),
    out: Path | None = typer.Argument(None, metavar="[OUT]", help="The run's --out."),
    out_flag: Path | None = typer.Option(None, "--out", "-o", help="OUT as the run's flag, in place of the argument."),
    config: Path | None = typer.Option(
        None,
        help="The run's --config file: its dataset and out keys where not given, and its settings.",
        is_eager=True,
        callback=load_config,
    ),
    *,
    options: EngineOptions,
    defaults: SamplingParams,
    job_options: JobOptions,
    input_options: InputOptions,
) -> None:
    """Show how far the run from DATASET to OUT has got: rows done, remaining and errored. Given the run's --config
    or its command line (`batchgen run`'s flags, --out among them: the run's command line with `status` for `run`),
    the settings a finished or partial OUT records are compared with the run's as --resume compares them. Exit status
    0 when OUT is a finished output with a row for every row of DATASET (and, with settings, made with them), 1 when
    rows remain or it was made otherwise (not started, stopped or in progress, finished with rows missing or changed
    since, or with other settings), 2 when DATASET, OUT, the config or the run's options cannot be read or are
    invalid."""
    from batchgen.api.checks import check_run_options
    from batchgen.job.resume import check_output_place
    from batchgen.job.status import read_output_status

    with user_errors(ctx):
        try:
            if out_flag is not None:  # over the config's out, as the argument is
                if given(ctx, "out") and out_flag != out:
                    raise BatchgenError(f"OUT is given twice: {out} and --out {out_flag}")
                out = out_flag
            if dataset is None or out is None:
                raise BatchgenError("status needs DATASET and OUT, as arguments or as the keys of its --config")
            # Settings are compared where the run's are given: its --config, or its command line (a flag of its own,
            # or OUT as its --out); `status DATASET OUT` alone looks at rows.
            if config is None and out_flag is None and not any(given(ctx, name) for name in OPTION_HINTS):
                found = read_output_status(dataset, out)
            else:
                check_run_options(options, defaults, job_options, input_options)  # a run with them would stop here
                check_output_place(dataset, out)
                found = read_output_status(
                    dataset, out, input_options, (options, defaults), force=job_options.resume_force
                )
        except BatchgenError as e:
            raise _swapped(e, dataset, out) from None
        except KeyboardInterrupt:  # Typer would end it with no word; status only reads, nothing to flush
            print("batchgen: interrupted", file=sys.stderr)
            raise typer.Exit(128 + signal.SIGINT) from None
    print("\n".join(found.lines()))
    if not found.complete:  # a scheduler's test, as `diff` answers 0 same, 1 different, 2 trouble
        raise typer.Exit(1)


def _swapped(error: BatchgenError, dataset: Path | None, out: Path | None) -> BatchgenError:
    """``error`` with a question where OUT is no batchgen output but DATASET is one: the two given the other way
    round (found by a new user, whose ``status OUT DATASET`` was told only that DATASET's rows are no output)."""
    from batchgen.io.finished_output import finished_rows

    said = str(error)
    if dataset is None or out is None or not ("not a batchgen output" in said or "unsupported output format" in said):
        return error
    try:
        finished_rows(dataset)
    except BatchgenError:
        return error
    return BatchgenError(f"{error} ({dataset} is one: DATASET and OUT swapped? status takes the dataset first)")
