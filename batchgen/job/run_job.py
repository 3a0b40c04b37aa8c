"""``batchgen run``: stream rows from a dataset through the engine into a resumable partial output, then put the
finished output file in place (see ``batchgen/io/partial_output.py`` for the files and their protocol)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
from tqdm import tqdm

from batchgen.errors import FieldError, OutputError, RowError, counted
from batchgen.io.field_warnings import warn_about_fields
from batchgen.io.input_digests import RunDigests
from batchgen.io.input_options import InputOptions
from batchgen.io.openai_output import openai_output, wants_openai_output
from batchgen.io.output_format import check_output_columns, check_output_format
from batchgen.io.part_file import rows_sample_ids
from batchgen.io.partial_output import PartialOutput, remove_partial_dir
from batchgen.io.reader import RowReader, count_input_rows
from batchgen.io.rows import RowSpec, parse_row, passthrough_that_fits
from batchgen.io.writer import OUTPUT_COLUMNS, result_schema
from batchgen.job.interrupts import StopRequest, graceful_stop
from batchgen.job.options import JobOptions
from batchgen.job.output_columns import NAMES_KEY
from batchgen.job.recent_rates import RecentRates
from batchgen.job.request_builder import RequestBuilder
from batchgen.job.result_rows import error_row
from batchgen.job.resume import open_output
from batchgen.job.rounds import LocalRounds, Rounds, RowResults
from batchgen.job.row_flow import RowChecks
from batchgen.job.run_metadata import RUN_SEED_KEY, run_metadata
from batchgen.job.summary import RunSummary
from batchgen.loop.generation_config import applied_note
from batchgen.loop.options import EngineOptions
from batchgen.sampling.row_fields import make_sampling_params
from batchgen.sampling.sampling_params import SamplingParams

# At most this many row errors are printed in full; the rest are counted.
MAX_PRINTED_ERRORS = 20


class RunJob:
    """One ``batchgen run``: reader → checks → RequestBuilder → engine (here, or replicas on a Ray cluster with
    ``job.ray``) → part files → output file, with the error policy.

    Args:
        job: the job's options: ``on_error`` ``fail`` (bad rows are reported on stderr, left out of the output, and
            the run exits 3 after finishing every good row), ``skip`` (bad rows are written with
            ``finish_reason="error"``) or ``auto`` (skip for OpenAI Batch output lines, else fail:
            :meth:`JobOptions.bad_rows`), resume or start over, how often finished rows are made durable, progress.

    Raises:
        BatchgenError: another run is writing the output (before the model loads, where its partial output is
            there); when resuming, a partial output written by a different job (unless ``job.resume_force``).
    """

    def __init__(
        self,
        dataset: Path,
        out: Path,
        engine_options: EngineOptions,
        defaults: SamplingParams,
        job: JobOptions,
        input_options: InputOptions | None = None,
    ) -> None:
        self.reader = RowReader(dataset, options=input_options)
        check_output_columns(out, self.reader.passthrough_schema)
        as_openai = wants_openai_output(job.output_format, self.reader.openai, out)
        self.out = out
        self.job = job
        self.defaults = defaults
        self.engine_options = engine_options
        self.output = PartialOutput(out)
        if self.output.exists():
            # Before the model loads (minutes for a large one): a run that another run keeps from the output, a
            # scheduled job overlapping the last one, fails at once.
            self.output.lock()
        try:
            self.rounds = self._rounds()
        except BaseException:
            self.output.close()
            raise
        self.facts = self.rounds.facts
        try:
            # Before the request builder exists: a resumed run reuses the recorded run seed.
            self.schema, self.resumed = open_output(
                dataset,
                self.output,
                result_schema(self.reader.passthrough_schema, self.metadata()),
                engine_options.seed,
                job,
            )
            run_seed = int(self.schema.metadata[RUN_SEED_KEY.encode()])
            kwargs = self.reader.options.chat_template_kwargs
            self.builder = RequestBuilder.for_engine(self.facts, defaults, run_seed, kwargs)  # a bad constraint
        except BaseException:
            self.close()
            raise
        note = applied_note(defaults.left_to_model, self.facts.sampling_defaults, self.facts.sampling_defaults_file)
        if note is not None:
            print(f"batchgen: {note}", file=sys.stderr)
        model, tokenizer, seed = engine_options.model, self.facts.tokenizer, self.builder.run_seed
        self.openai_output = openai_output(dataset, self.reader.openai, as_openai, model, tokenizer, seed)
        chosen = "max_new_tokens" not in defaults.left_to_model or "max_new_tokens" in self.facts.sampling_defaults
        built_in_max = None if chosen else self.builder.defaults.max_new_tokens
        warn_about_fields(self.reader, built_in_max, self.facts.tokenizer, check_output_format(out) != ".jsonl")
        self.summary = RunSummary(on_error=self.job.bad_rows(self.openai_output is not None))
        # The output's pass-through columns: the dataset's, or, resuming, those combined with the rows written.
        passthrough = pa.schema([field for field in self.schema if field.name not in OUTPUT_COLUMNS.names])
        names = json.loads(self.schema.metadata[NAMES_KEY.encode()])  # resuming, as the rows written have them
        # Every input row's digest: the output records them, and a later --resume checks its rows against them.
        self.digests = RunDigests()
        self.checks = RowChecks(
            self.reader.source,
            lambda row: parse_row(row, row.source or self.reader.source, passthrough, names),
            lambda row: passthrough_that_fits(row.data, passthrough, names),
            index_ids=self.reader.index_ids,
            on_claim=self.digests.claim,
        )
        self._pending_rows: list[dict[str, Any]] = []

    def _rounds(self) -> Rounds:
        if self.job.ray:
            from batchgen.job.ray_rounds import RayRounds  # imports Ray, an optional extra

            return RayRounds(self.engine_options, self.job)
        return LocalRounds(self.engine_options)

    def metadata(self) -> dict[str, str]:
        names = {NAMES_KEY: json.dumps(self.reader.passthrough_names)}
        return run_metadata(self.engine_options, self.defaults, self.reader.options, self.facts) | names

    def run(self) -> RunSummary:
        """Generate every row not yet done; when all are, put the output file in place. After a stop signal
        (``summary.interrupted_by``), an error or an exception, the finished rows are flushed to the partial
        output (rows in flight are not) and the run can be resumed."""
        with graceful_stop() as stop:
            try:
                self._run(stop)
            finally:
                self.close()
        return self.summary

    def close(self) -> None:
        """Release the output's lock and the engine: a caller in Python may try again in this process."""
        self.output.close()
        self.rounds.close()

    def _run(self, stop: StopRequest) -> None:
        start = time.perf_counter()
        # Before the partial output exists: a dataset unreadable part way leaves nothing behind to --resume.
        total = count_input_rows(self.reader.path) if self.job.progress else None
        self.output.start(self.schema, self.resumed)
        if self.job.overwrite:  # under the lock: a run putting OUT in place holds it until OUT is there
            self.out.unlink(missing_ok=True)
        done = self.output.state.done
        if self.job.resuming:
            were = "was" if done.count == 1 else "were"
            before = (
                f"{counted(done.count, 'row')} {were} done before"
                if self.resumed
                else "no partial output, starting at the top"
            )
            print(f"batchgen: resuming {self.out}: {before}", file=sys.stderr)
        try:
            # Closed before anything below prints, so that no message shares the bar's line.
            with tqdm(
                total=total,
                initial=done.count,
                unit="req",
                file=sys.stderr,
                disable=not self.job.progress,
                dynamic_ncols=True,
            ) as bar:
                self._generate(stop, bar, start)
            self._flush()
        except BaseException as e:
            self._flush_after_failure(e)
            raise
        if stop.signum is not None:
            self.summary.interrupted_by = stop.name
        elif self.output.state.parts:
            render = self.openai_output.render if self.openai_output is not None else None
            self.output.finalize(self.digests.metadata(), render)
        else:  # every row was bad (--on-error fail): no empty output file that the next try must --overwrite
            self.summary.output_written = False
            self._discard_empty_partial()
        self.summary.seconds = time.perf_counter() - start
        self.summary.preemptions = self.rounds.preemptions
        if self.engine_options.prefix_cache:
            self.summary.cached_share = self.rounds.stats.cached_share or 0.0
        self.summary.accept_histogram = dict(self.rounds.accept_histogram)

    def _generate(self, stop: StopRequest, bar: tqdm, start: float) -> None:
        """Feed the engine from the input and collect finished requests until both are done or a stop arrives,
        flushing finished rows every ``flush_every`` rows or ``flush_every_seconds``."""
        last_flush = time.monotonic()
        rates = RecentRates(start)  # the engine is this job's: its token counts start at 0

        def on_bad_row(error: RowError, rid: str, passthrough: dict[str, Any]) -> None:
            self._row_failed(error, rid, passthrough, bar)

        def on_failed_request(error: RowError, rid: str, passthrough: dict[str, Any]) -> None:
            self.digests.drop(rid)  # a row that ran: not a duplicate, whose id is another row's
            self._row_failed(error, rid, passthrough, bar)

        rows = self.checks.checked(self.reader, on_bad_row, self._is_done)
        lookahead = max(self.job.schedule_lookahead, 2 * self.facts.max_running_requests)
        for finished in self.rounds.results(rows, self.builder, on_failed_request, lookahead):
            for results in finished:
                self._finish(results, bar)
            if self.job.progress:
                stats = self.rounds.stats
                prefill, decode = rates.update(time.perf_counter(), stats.prefill_tokens, stats.decode_tokens)
                share = stats.cached_share if self.engine_options.prefix_cache else None
                cached = f", cache {100 * share:.0f} %" if share is not None else ""
                bar.set_postfix_str(f"prefill {prefill:.0f} tok/s, decode {decode:.0f} tok/s{cached}", refresh=False)
            overdue = time.monotonic() - last_flush >= self.job.flush_every_seconds
            if len(self._pending_rows) >= self.job.flush_every or overdue:
                self._flush()
                last_flush = time.monotonic()
            if stop.signum is not None:
                break

    def _is_done(self, spec: RowSpec) -> bool:
        """Whether an earlier run wrote all of the row's samples."""
        done = self.output.state.done
        return spec.id in done.samples and done.is_done(spec.id, self._samples_of(spec))

    def _flush(self) -> None:
        rows = self._pending_rows
        self.output.write_part(rows, self.digests.written(rows_sample_ids(rows)))
        self._pending_rows = []

    def _discard_empty_partial(self) -> None:
        """Remove a partial output that holds no rows: left behind, it would only ask the rerun for --resume or
        --overwrite."""
        self.output.close()
        with contextlib.suppress(OSError):
            remove_partial_dir(self.output.dir)

    def _flush_after_failure(self, error: BaseException) -> None:
        """Keep what finished before ``error``; a flush that fails now is not reported, ``error`` is."""
        with contextlib.suppress(Exception):  # the original error is the one the user needs to see
            self._flush()
        if not self.output.state.parts:  # nothing finished (an input file unreadable at its first rows)
            self._discard_empty_partial()
        elif not isinstance(error, OutputError):
            # The output's own errors say how to go on; an input file damaged part way does not.
            print(
                f"batchgen: the rows finished so far are kept in {self.output.dir}; rerun with --resume once that is "
                "mended (the rows written are checked against the mended dataset)",
                file=sys.stderr,
            )

    def _finish(self, results: RowResults, bar: tqdm) -> None:
        # All samples of a row go into one part, so a part holds all of a row's samples or none of them.
        self._pending_rows.extend(results)
        self.summary.rows += 1
        self.summary.samples += len(results)
        self.summary.output_tokens += sum(row["completion_tokens"] for row in results)
        self.summary.prompt_tokens += results[0]["prompt_tokens"]  # the samples of a row share one prompt
        bar.update(1)

    def _samples_of(self, spec: RowSpec) -> int:
        """The row's ``n`` (0 for a row whose sampling fields are bad: it is never done by its samples)."""
        try:
            # The builder's defaults: the run's with the model's generation_config.json's, as the row ran with them.
            return make_sampling_params(self.builder.defaults, spec.sampling_overrides, self.facts.vocab_size).n
        except FieldError:
            return 0

    def _row_failed(self, error: RowError, rid: str, passthrough: dict[str, Any], bar: tqdm) -> None:
        skip = self.summary.on_error == "skip"
        # An earlier run (--on-error skip) wrote this error row: kept, and under fail still a bad row, so that the
        # run's exit says so (found by a helper: a resume under fail over it exited 0 with "0 bad rows").
        written = self.output.state.done.take_error(rid, str(error))
        if written and skip:
            return
        self.summary.errors += 1
        bar.update(1)  # a bad row is one of the input's rows too: the bar ends at its total
        # skip: the run succeeds, but a user scanning stderr still learns which rows went wrong, and why.
        kind = "warning" if skip else "error"
        if self.summary.errors <= MAX_PRINTED_ERRORS:
            said = " (written as an error row)" if skip else " (its error row, written before, stays)" * written
            tqdm.write(f"batchgen: {kind}: {error}{said}", file=sys.stderr)
        elif self.summary.errors == MAX_PRINTED_ERRORS + 1:
            tqdm.write(f"batchgen: {kind}: more bad rows; only the first 20 are shown", file=sys.stderr)
        if skip:
            self._pending_rows.append(error_row(error, rid, passthrough))
