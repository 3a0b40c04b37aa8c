"""``batchgen.run``: what ``batchgen run`` does, from Python; :func:`run_dataset` is the part the command line
shares (it prints the summary and turns the outcome into an exit status itself)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from batchgen.api.checks import check_run_options, check_sampling_defaults
from batchgen.api.config_file import with_config
from batchgen.api.options import OPTION_CLASSES, check_option_names, options_of, run_sampling_defaults
from batchgen.environment import thread_count_chosen
from batchgen.errors import counted
from batchgen.io.input_options import InputOptions
from batchgen.io.partial_output import partial_dir
from batchgen.job.interrupts import HANDLED_SIGNALS
from batchgen.job.options import JobOptions
from batchgen.job.summary import RunSummary, raise_if_failed
from batchgen.loop.options import EngineOptions, pick_device
from batchgen.sampling.sampling_params import SamplingParams


class RunInterrupted(KeyboardInterrupt):
    """:func:`run` stopped by SIGINT, SIGTERM or SIGHUP: the rows finished are flushed to the partial output
    (``partial_dir``), which ``run(..., resume=True)`` continues. The caller's own signal handlers are back in
    place when it is raised (the command line keeps batchgen's: there a second signal ends the process at once).

    Attributes:
        signal_name: ``SIGINT``, ``SIGTERM`` or ``SIGHUP``.
        summary: what the run did until then.
        partial_dir: the partial output directory.
    """

    def __init__(self, signal_name: str, summary: RunSummary, partial_dir: Path) -> None:
        self.signal_name = signal_name
        self.summary = summary
        self.partial_dir = partial_dir
        super().__init__(
            f"stopped by {signal_name}: {counted(summary.rows, 'row')} finished in this run "
            f"{'is' if summary.rows == 1 else 'are'} flushed to {partial_dir}; "
            "rerun with resume=True"
        )


def run(
    dataset: str | os.PathLike[str] | None = None,
    out: str | os.PathLike[str] | None = None,
    config: str | os.PathLike[str] | None = None,
    **options: Any,
) -> RunSummary:
    """Generate a completion for every row of ``dataset`` and write one result row per sample to ``out``, as
    ``batchgen run DATASET --out OUT`` does (formats, resume, error rows, the partial output: docs/input-output.md).

    Progress, warnings and row errors go to stderr as the command line prints them; the summary line does not
    (``summary.line()`` gives it).

    Args:
        dataset: a ``.jsonl``, ``.parquet`` or ``.arrow`` file of rows, or a directory or glob of such shards.
        out: the output file, ``.arrow``, ``.parquet`` or ``.jsonl``.
        config: a YAML file of options, as ``--config`` takes it (long flag names as keys; ``dataset`` and ``out``
            may be among them); the arguments and keywords given (not ``None``) override its values, as flags do.
        **options: ``batchgen run``'s options by their Python names: engine options (``model``, ``dtype``,
            ``device``...), sampling defaults (``max_new_tokens``, ``temperature``, ``stop``...) and job options
            (``on_error``, ``overwrite``, ``resume``, ``progress``...), input options (``prompt_column``,
            ``prompt_template``...).

    Returns:
        What the run did (an empty summary when ``resume=True`` finds ``out`` complete).

    Raises:
        TypeError: an option that ``batchgen run`` does not have, named; a dataset, out or config that is no path.
        BatchgenError: a bad option, config file, input or output path (the command line's one-line message, naming
            the flag); under ``on_error="fail"``, bad rows, after every good row is written.
        RunInterrupted: a stop signal (a ``KeyboardInterrupt``), after the finished rows are flushed.
    """
    check_option_names(options, OPTION_CLASSES, "run")
    for name, path in (("dataset", dataset), ("out", out), ("config", config)):
        if path is not None and not isinstance(path, (str, os.PathLike)):
            rows = " (rows held in Python: batchgen.Generator(...).generate(rows))" if name == "dataset" else ""
            raise TypeError(f"run(): {name} must be a path, got {type(path).__name__}{rows}")
    options = with_config(config, {"dataset": dataset, "out": out, **options})
    dataset, out = options.pop("dataset", None), options.pop("out", None)
    if dataset is None or out is None:
        raise TypeError(f"run() needs {'dataset' if dataset is None else 'out'}, as an argument or a config file's key")
    job_options = options_of(JobOptions, options)
    handlers = {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS}
    engine_options, defaults = options_of(EngineOptions, options), run_sampling_defaults(options)
    input_options = options_of(InputOptions, options)
    summary = run_dataset(Path(dataset), Path(out), engine_options, defaults, job_options, input_options)
    if summary is None:
        return RunSummary()
    if summary.interrupted_by:
        if threading.current_thread() is threading.main_thread():  # elsewhere the job installed no handler
            for sig, handler in handlers.items():
                if handler is not None:  # None: a handler not set from Python, which cannot be put back
                    signal.signal(sig, handler)
        raise RunInterrupted(summary.interrupted_by, summary, partial_dir(Path(out)))
    raise_if_failed(summary, Path(out))
    return summary


def run_dataset(
    dataset: Path,
    out: Path,
    options: EngineOptions,
    defaults: SamplingParams,
    job_options: JobOptions,
    input_options: InputOptions,
) -> RunSummary | None:
    """Check the options and the output path, then run the job: its summary (``interrupted_by`` set after a stop
    signal, ``errors`` counting bad rows), or ``None`` when ``--resume`` finds ``out`` already complete (said on
    stderr).

    Raises:
        BatchgenError: a bad option, input or output path; an error of the job that stops it.
    """
    from batchgen.job.resume import check_output_path, discard_partial_beside
    from batchgen.job.run_job import RunJob

    check_run_options(options, defaults, job_options, input_options)  # before the output's checks and the model
    if check_output_path(dataset, out, job_options.overwrite, job_options.resuming):
        from batchgen.job.status import check_nothing_left

        # A finished output that lacks rows is reopened by the job, which adds them.
        complete = check_nothing_left(dataset, out, job_options.resume_force, input_options)
        discard_partial_beside(out)
        if complete:
            from batchgen.job.run_metadata import check_finished_settings

            check_finished_settings(dataset, out, options, defaults, input_options, job_options.resume_force)
            print(f"batchgen: {out} is already complete; nothing to do", file=sys.stderr)
            return None
    if pick_device(options.device).type == "cpu" and not job_options.ray:
        warn_if_cores_busy()
    job = RunJob(dataset, out, options, defaults, job_options, input_options)
    try:
        check_sampling_defaults(defaults, job.facts)
    except BaseException:
        job.close()
        raise
    return job.run()


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
