"""``batchgen run``: the command's options and what it prints over :func:`batchgen.api.run.run_dataset`, the job
that ``batchgen.run`` runs from Python."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import typer

from batchgen.cli import hold_finished_interrupts
from batchgen.cli.config import load_config
from batchgen.cli.options import with_options
from batchgen.cli.user_errors import user_errors
from batchgen.errors import counted
from batchgen.io.input_options import InputOptions
from batchgen.job.options import JobOptions
from batchgen.job.summary import peak_rss_mib
from batchgen.loop.options import EngineOptions
from batchgen.sampling.sampling_params import SamplingParams


@with_options(starts_until_its_handlers=True)
def run(
    ctx: typer.Context,
    dataset: Path = typer.Argument(
        ...,
        metavar="DATASET",
        help="Prompts: .jsonl (one JSON object per line), .parquet or .arrow; or a directory or quoted glob of shards.",
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Results: .arrow (Arrow IPC file), .parquet or .jsonl."),
    config: Path | None = typer.Option(
        None, help="YAML file of option defaults (keys as the long flags).", is_eager=True, callback=load_config
    ),
    *,
    options: EngineOptions,
    defaults: SamplingParams,
    job_options: JobOptions,
    input_options: InputOptions,
) -> None:
    """Generate a completion for every row of DATASET and write one result row per prompt to OUT."""
    with user_errors(ctx):
        try:
            # Imported within the Ctrl-C's reach too: they take seconds, and Typer would end a KeyboardInterrupt
            # raised outside this block with no word.
            from transformers.utils import logging as transformers_logging

            from batchgen.api.run import run_dataset
            from batchgen.io.partial_output import partial_dir
            from batchgen.job.resume import resume_command
            from batchgen.job.summary import raise_if_failed

            # batchgen reports problems with the input itself, one line each; transformers' notes would only add noise.
            transformers_logging.set_verbosity_error()
            summary = run_dataset(dataset, out, options, defaults, job_options, input_options)
            if summary is None or not summary.interrupted_by:  # else the run's own handlers stay: the second stop
                hold_finished_interrupts()
        except KeyboardInterrupt:  # before the job's own handlers are in place: loading the model, building kernels
            print("batchgen: interrupted while starting, before any row ran", file=sys.stderr)
            raise typer.Exit(128 + signal.SIGINT) from None
        if summary is None:  # already complete
            return
        if summary.interrupted_by:  # said first, so the summary below does not read as a finished run
            # --on-error skip writes error rows too; they are flushed with the rest.
            skipped = summary.on_error == "skip" and summary.errors
            also = f" and {counted(summary.errors, 'error row')}" if skipped else ""
            verb = "is" if summary.rows == 1 and not also else "are"
            print(
                f"batchgen: stopped by {summary.interrupted_by}: the {counted(summary.rows, 'row')} finished in this "
                f"run{also} {verb} flushed to {partial_dir(out)}; requests still running were dropped",
                file=sys.stderr,
            )
        print(summary.line(), file=sys.stderr)
        if job_options.report_memory:
            print(f"batchgen: peak RSS {peak_rss_mib():.0f} MiB", file=sys.stderr)
        if summary.interrupted_by:
            print(f"batchgen: to resume: {resume_command(dataset, out)}", file=sys.stderr)
            raise typer.Exit(128 + signal.Signals[summary.interrupted_by].value)
        raise_if_failed(summary, Path(out))
