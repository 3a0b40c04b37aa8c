"""``batchgen run``: the command's options, their checks, and the job it starts."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import typer

from batchgen.cli.config import load_config
from batchgen.cli.options import with_options
from batchgen.cli.user_errors import user_errors
from batchgen.environment import thread_count_chosen
from batchgen.errors import BatchgenError, FieldError
from batchgen.io.input_options import InputOptions
from batchgen.job.options import JobOptions
from batchgen.job.summary import peak_rss_mib
from batchgen.loop.options import EngineOptions, pick_device
from batchgen.sampling.sampling_params import SamplingParams


def _check_sampling_defaults(defaults: SamplingParams, vocab_size: int | None) -> None:
    """Validate the sampling defaults (against the model's vocabulary once it is known; ``None``: the checks that
    need none).

    Raises:
        BatchgenError: naming the option.
    """
    try:
        defaults.validate(vocab_size if vocab_size is not None else sys.maxsize)
    except FieldError as e:
        raise BatchgenError(f"--{e.field.replace('_', '-')}: {e.message}") from None


def warn_if_cores_busy() -> None:
    """One line on stderr when the 1-minute load average exceeds the threads batchgen computes with: other processes
    then hold the cores it counts on, and a CPU run slows several-fold (18x seen) without a word. Unless
    ``$OMP_NUM_THREADS`` is set: the thread count is then the user's choice."""
    load = os.getloadavg()[0]
    threads = torch.get_num_threads()
    if load > threads and not thread_count_chosen():
        print(
            f"batchgen: warning: the load average is {load:.1f}, above the {threads} cores batchgen computes on: "
            "other processes compete for them and this run will be slower (set OMP_NUM_THREADS to the idle cores)",
            file=sys.stderr,
        )


@with_options()
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
    from transformers.utils import logging as transformers_logging

    from batchgen.job.resume import check_output_path, resume_command
    from batchgen.job.run_job import RunJob
    from batchgen.job.summary import raise_if_failed

    # batchgen reports problems with the input itself, one line each; transformers' notes would only add noise.
    transformers_logging.set_verbosity_error()
    with user_errors(ctx):
        job_options.validate()
        input_options.validate()
        options.validate()  # before the output's checks: a mistyped flag is named first
        _check_sampling_defaults(defaults, None)  # what needs no model, before loading it
        if check_output_path(dataset, out, job_options.overwrite, job_options.resuming):
            from batchgen.job.status import check_nothing_left

            # A finished output that lacks rows is reopened by the job, which adds them.
            if check_nothing_left(dataset, out, job_options.resume_force, input_options):
                print(f"batchgen: {out} is already complete; nothing to do", file=sys.stderr)
                return
        if pick_device(options.device).type == "cpu":
            warn_if_cores_busy()
        job = RunJob(dataset, out, options, defaults, job_options, input_options)
        _check_sampling_defaults(defaults, job.engine.vocab_size)
        if defaults.n > job.engine.max_running_requests:
            raise BatchgenError(f"--n {defaults.n} exceeds --max-running-requests {job.engine.max_running_requests}")
        summary = job.run()
        if summary.interrupted_by:  # said first, so the summary below does not read as a finished run
            # --on-error skip writes error rows too; they are flushed with the rest.
            also = f" and {summary.errors} error rows" if job_options.on_error == "skip" and summary.errors else ""
            print(
                f"batchgen: stopped by {summary.interrupted_by}: the {summary.rows} rows finished in this run{also} "
                f"are flushed to {job.output.dir}; requests still running were dropped",
                file=sys.stderr,
            )
        print(summary.line(), file=sys.stderr)
        if job_options.report_memory:
            print(f"batchgen: peak RSS {peak_rss_mib():.0f} MiB", file=sys.stderr)
        if summary.interrupted_by:
            print(f"batchgen: to resume: {resume_command(dataset, out)}", file=sys.stderr)
            raise typer.Exit(128 + signal.Signals[summary.interrupted_by].value)
        raise_if_failed(summary, job_options.on_error)
