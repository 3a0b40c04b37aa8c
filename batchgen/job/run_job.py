"""``batchgen run``: stream rows from a dataset through the engine into a resumable partial output, then put the
finished output file in place (see ``batchgen/io/partial_output.py`` for the files and their protocol)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from batchgen import __version__
from batchgen.errors import BatchgenError, FieldError, RowError
from batchgen.io.field_warnings import (
    warn_about_json_text_fields,
    warn_about_passthrough_names,
    warn_about_sampling_columns,
)
from batchgen.io.input_digests import (
    DIGEST_BYTES,
    INPUT_DIGESTS_KEY,
    MAX_DIGESTED_ROWS,
    encode_digests,
    row_digest,
)
from batchgen.io.input_options import INPUT_OPTIONS_KEY, InputOptions
from batchgen.io.openai_output import openai_output, wants_openai_output
from batchgen.io.partial_output import PartialOutput, remove_partial_dir
from batchgen.io.reader import InputRow, RowReader, count_input_rows
from batchgen.io.rows import RowSpec, error_row_id, parse_row, passthrough_that_fits
from batchgen.io.writer import result_schema
from batchgen.job.interrupts import StopRequest, graceful_stop
from batchgen.job.options import JobOptions
from batchgen.job.recent_rates import RecentRates
from batchgen.job.request_builder import RequestBuilder
from batchgen.job.result_rows import error_row
from batchgen.job.resume import RUN_SEED_KEY, open_output
from batchgen.job.row_flow import RowFlow
from batchgen.job.summary import RunSummary
from batchgen.loop.engine import Engine
from batchgen.loop.options import EngineOptions
from batchgen.loop.req import Req
from batchgen.sampling.sampling_params import SamplingParams, make_sampling_params
from batchgen.speculative import make_drafter

# At most this many row errors are printed in full; the rest are counted.
MAX_PRINTED_ERRORS = 20


class RunJob:
    """One ``batchgen run``: reader → RequestBuilder → Engine → part files → output file, with the error policy.

    Args:
        job: the job's options: ``on_error`` ``fail`` (bad rows are reported on stderr, left out of the output, and
            the run exits 2 after finishing every good row) or ``skip`` (bad rows are written with
            ``finish_reason="error"``), resume or start over, how often finished rows are made durable, progress.

    Raises:
        BatchgenError: when resuming, a partial output written by a different job (unless ``job.resume_force``).
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
        as_openai = wants_openai_output(job.output_format, self.reader.openai, out)
        self.out = out
        self.job = job
        self.defaults = defaults
        self.engine_options = engine_options
        self.engine = Engine(engine_options, make_drafter)
        self.output = PartialOutput(out)
        # Before the request builder exists: a resumed run reuses the recorded run seed.
        self.schema, self.resumed = open_output(
            dataset,
            self.output,
            result_schema(self.reader.passthrough_schema, self.metadata()),
            engine_options.seed,
            job,
        )
        self.builder = RequestBuilder(
            self.engine.tokenizer,
            self.engine.vocab_size,
            self.engine.context_len,
            self.engine.eos_token_ids,
            defaults,
            int(self.schema.metadata[RUN_SEED_KEY.encode()]),
            max_samples=self.engine.max_running_requests,
        )
        model, tokenizer, seed = engine_options.model, self.engine.tokenizer, self.builder.run_seed
        self.openai_output = openai_output(dataset, self.reader.openai, as_openai, model, tokenizer, seed)
        warn_about_passthrough_names(self.reader.path, self.reader.passthrough_schema.names)
        warn_about_sampling_columns(self.reader.path, self.reader.options)
        warn_about_json_text_fields(self.reader.path, self.reader.passthrough_schema, self.reader.block_rows)
        self.summary = RunSummary()
        self.flow = RowFlow(
            self.engine,
            self.builder,
            self.reader.source,
            lambda row: parse_row(
                row,
                row.source or self.reader.source,
                self.reader.passthrough_schema,
                self.reader.passthrough_names,
                block_rows=self.reader.block_rows,
            ),
            lambda row: passthrough_that_fits(row.data, self.reader.passthrough_schema, self.reader.passthrough_names),
            max(job.schedule_lookahead, 2 * self.engine.max_running_requests),
        )
        # Every input row's digest, for the output's metadata: a later --resume checks its rows against them.
        self._digests = bytearray()
        self._pending_rows: list[dict[str, Any]] = []

    def metadata(self) -> dict[str, str]:
        return {
            "batchgen.version": __version__,
            "batchgen.model": self.engine_options.model,
            "batchgen.model_dir": str(self.engine.model_dir),
            "batchgen.dtype": str(self.engine.dtype).removeprefix("torch."),
            "batchgen.kernel_switches": json.dumps(self.engine.switches.as_metadata()),
            "batchgen.logprobs_mode": self.engine_options.logprobs_mode,
            "batchgen.deterministic": str(self.engine.deterministic).lower(),
            "batchgen.sampling_defaults": json.dumps(asdict(self.defaults)),
            "batchgen.engine_options": json.dumps(asdict(self.engine_options)),
            INPUT_OPTIONS_KEY: json.dumps(asdict(self.reader.options)),
        }

    def run(self) -> RunSummary:
        """Generate every row not yet done; when all are, put the output file in place. After a stop signal
        (``summary.interrupted_by``), an error or an exception, the finished rows are flushed to the partial
        output (rows in flight are not) and the run can be resumed."""
        with graceful_stop() as stop:
            try:
                self._run(stop)
            finally:
                self.output.close()
        return self.summary

    def _run(self, stop: StopRequest) -> None:
        start = time.perf_counter()
        if self.job.overwrite:
            self.out.unlink(missing_ok=True)
        self.output.start(self.schema, self.resumed)
        done = self.output.state.done
        if self.job.resuming:
            before = f"{done.count} rows were done before" if self.resumed else "no partial output, starting at the top"
            print(f"batchgen: resuming {self.out}: {before}", file=sys.stderr)
        total = count_input_rows(self.reader.path) if self.job.progress else None
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
            digested = len(self._digests) <= MAX_DIGESTED_ROWS * DIGEST_BYTES
            metadata = {INPUT_DIGESTS_KEY: encode_digests(bytes(self._digests))} if digested else {}
            self.output.finalize(metadata, self.openai_output.render if self.openai_output is not None else None)
        else:  # every row was bad (--on-error fail): no empty output file that the next try must --overwrite
            self.summary.output_written = False
            self.output.close()
            with contextlib.suppress(OSError):  # it holds no rows; a directory left behind only asks for --resume
                remove_partial_dir(self.output.dir)
        self.summary.seconds = time.perf_counter() - start
        self.summary.preemptions = self.engine.scheduler.num_retracted
        if self.engine.options.prefix_cache:
            self.summary.cached_share = self.engine.stats.cached_share or 0.0
        self.summary.accept_histogram = dict(self.engine.scheduler.accept_histogram)

    def _generate(self, stop: StopRequest, bar: tqdm, start: float) -> None:
        """Feed the engine from the input and collect finished requests until both are done or a stop arrives,
        flushing finished rows every ``flush_every`` rows or ``flush_every_seconds``."""
        last_flush = time.monotonic()
        rates = RecentRates(start)  # the engine is this job's: its token counts start at 0
        done = self.output.state.done
        requests = self.flow.requests(
            self._digested(self.reader),
            lambda error, rid, passthrough: self._row_failed(error, rid, passthrough, bar),
            lambda spec: spec.id in done.samples and done.is_done(spec.id, self._samples_of(spec)),
        )
        for finished in self.flow.rounds(requests):
            for req in finished:
                self._finish(req, bar)
            if self.job.progress:
                stats = self.engine.stats
                prefill, decode = rates.update(time.perf_counter(), stats.prefill_tokens, stats.decode_tokens)
                share = self.engine.stats.cached_share if self.engine.options.prefix_cache else None
                cached = f", cache {100 * share:.0f} %" if share is not None else ""
                bar.set_postfix_str(f"prefill {prefill:.0f} tok/s, decode {decode:.0f} tok/s{cached}", refresh=False)
            overdue = time.monotonic() - last_flush >= self.job.flush_every_seconds
            if len(self._pending_rows) >= self.job.flush_every or overdue:
                self._flush()
                last_flush = time.monotonic()
            if stop.signum is not None:
                break

    def _flush(self) -> None:
        self.output.write_part(self._pending_rows)
        self._pending_rows = []

    def _flush_after_failure(self, error: BaseException) -> None:
        """Keep what finished before ``error``; a flush that fails now is not reported, ``error`` is."""
        with contextlib.suppress(Exception):  # the original error is the one the user needs to see
            self._flush()
        if not isinstance(error, BatchgenError):  # a BatchgenError says how to go on itself, in one line
            print(
                f"batchgen: the rows finished so far are kept in {self.output.dir}; rerun with --resume",
                file=sys.stderr,
            )

    def _finish(self, req: Req, bar: tqdm) -> None:
        rows = self.flow.result_rows(req)
        if rows:  # all samples of a row go into one part, so a part holds all of a row's samples or none of them
            self._pending_rows.extend(rows)
            self.summary.rows += 1
        self.summary.samples += 1
        self.summary.output_tokens += len(req.output_ids)
        if req.sample_index == 0:  # the samples of a row share one prompt, and count as one input row
            self.summary.prompt_tokens += len(req.prompt_ids)
            bar.update(1)

    def _digested(self, items: Iterable[InputRow | RowError]) -> Iterator[InputRow | RowError]:
        """``items``, recording each readable row's digest on its way."""
        for item in items:
            if isinstance(item, InputRow) and len(self._digests) <= MAX_DIGESTED_ROWS * DIGEST_BYTES:
                self._digests += row_digest(error_row_id(item), item.data)  # past the limit, one more says "too many"
            yield item

    def _samples_of(self, spec: RowSpec) -> int:
        """The row's ``n`` (0 for a row whose sampling fields are bad: it is never done by its samples)."""
        try:
            return make_sampling_params(self.defaults, spec.sampling_overrides, self.engine.vocab_size).n
        except FieldError:
            return 0

    def _row_failed(self, error: RowError, rid: str, passthrough: dict[str, Any], bar: tqdm) -> None:
        if self.output.state.done.take_error(rid):
            return  # an earlier run wrote this error row (--on-error skip)
        self.summary.errors += 1
        bar.update(1)  # a bad row is one of the input's rows too: the bar ends at its total
        skip = self.job.on_error == "skip"
        # skip: the run succeeds, but a user scanning stderr still learns which rows went wrong, and why.
        kind = "warning" if skip else "error"
        if self.summary.errors <= MAX_PRINTED_ERRORS:
            tqdm.write(f"batchgen: {kind}: {error}{' (written as an error row)' if skip else ''}", file=sys.stderr)
        elif self.summary.errors == MAX_PRINTED_ERRORS + 1:
            tqdm.write(f"batchgen: {kind}: more bad rows; only the first 20 are shown", file=sys.stderr)
        if skip:
            self._pending_rows.append(error_row(error, rid, passthrough))
