"""``batchgen run``: stream rows from a dataset through the engine and write one result row per prompt."""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from batchgen import __version__
from batchgen.errors import BatchgenError, RowError
from batchgen.interrupts import StopRequest, graceful_stop
from batchgen.io.reader import RowReader
from batchgen.io.rows import parse_row
from batchgen.io.writer import open_result_writer
from batchgen.loop.engine import Engine
from batchgen.loop.options import EngineOptions
from batchgen.loop.req import Req
from batchgen.loop.request_builder import RequestBuilder
from batchgen.sampling.sampling_params import SAMPLING_FIELDS, SamplingParams

# Finished rows are handed to the writer at least this often, so a long job's output grows steadily.
FLUSH_EVERY_ROWS = 256
FLUSH_EVERY_SECONDS = 5.0
# At most this many row errors are printed in full; the rest are counted.
MAX_PRINTED_ERRORS = 20


@dataclass
class RunSummary:
    """What a run did: rows written and failed, tokens in and out, wall seconds."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    preemptions: int = 0
    # The signal that stopped the run early, e.g. "SIGTERM"; empty when it ran to the end.
    interrupted_by: str = ""

    def line(self) -> str:
        rate = self.output_tokens / self.seconds if self.seconds > 0 else 0.0
        return (
            f"batchgen: {self.requests} requests ({self.errors} errors), {self.prompt_tokens} prompt + "
            f"{self.output_tokens} output tokens in {self.seconds:.1f} s, {rate:.1f} output tok/s, "
            f"{self.preemptions} preemptions"
        )


def result_row(req: Req) -> dict[str, Any]:
    """The output row of a finished request (columns as in ``batchgen.io.writer.OUTPUT_COLUMNS``)."""
    params = req.params
    return {
        "id": req.rid,
        "sample_index": req.sample_index,
        "text": req.text,
        "output_token_ids": req.output_ids,
        "output_logprobs": req.output_logprobs if params.logprobs else None,
        "top_logprobs": req.output_top_logprobs if params.logprobs and params.top_logprobs else None,
        "finish_reason": req.finish_reason,
        "matched_stop": req.matched_stop,
        "error": None,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "prompt_logprobs": req.prompt_logprobs if params.prompt_logprobs is not None else None,
        "prompt_top_logprobs": req.prompt_top_logprobs if params.prompt_logprobs else None,
        **req.passthrough,
    }


def error_row(error: RowError, rid: str, passthrough: dict[str, Any]) -> dict[str, Any]:
    """The output row written for a bad input row under ``--on-error skip``."""
    return {"id": rid, "finish_reason": "error", "error": str(error), **passthrough}


# Names other engines use for sampling fields, so that a row written for them is not silently half-understood.
_FOREIGN_SAMPLING_NAMES = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "stop_sequences": "stop",
    "best_of": None,
    "response_format": None,
}


def warn_about_passthrough_names(names: list[str]) -> None:
    """Print one warning per pass-through field that looks like a sampling field batchgen does not read."""
    known = {name.lower(): name for name in SAMPLING_FIELDS}
    for name in names:
        hint = known.get(name.lower())
        if hint is None and name in _FOREIGN_SAMPLING_NAMES:
            hint = _FOREIGN_SAMPLING_NAMES[name]
            if hint is None:
                print(
                    f"batchgen: warning: field '{name}' is not supported (yet); it is passed through unused",
                    file=sys.stderr,
                )
                continue
        if hint is not None:
            print(
                f"batchgen: warning: field '{name}' is not a sampling field (did you mean '{hint}'?); it is passed "
                "through unused",
                file=sys.stderr,
            )


def count_rows(path: Path) -> int | None:
    """Rows in the dataset, for the progress bar (non-blank JSONL lines; Parquet metadata)."""
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


class RunJob:
    """One ``batchgen run``: reader → RequestBuilder → Engine → writer, with the error policy.

    Args:
        on_error: ``fail`` (bad rows are reported on stderr, left out of the output, and the run exits 2 after
            finishing every good row) or ``skip`` (bad rows are written with ``finish_reason="error"``).
    """

    def __init__(
        self,
        dataset: Path,
        out: Path,
        engine_options: EngineOptions,
        defaults: SamplingParams,
        on_error: str,
        progress: bool,
    ) -> None:
        self.reader = RowReader(dataset)
        self.out = out
        self.on_error = on_error
        self.progress = progress
        self.defaults = defaults
        self.engine_options = engine_options
        self.engine = Engine(engine_options)
        run_seed = engine_options.seed if engine_options.seed is not None else secrets.randbits(63)
        self.builder = RequestBuilder(
            self.engine.tokenizer,
            self.engine.vocab_size,
            self.engine.context_len,
            self.engine.eos_token_ids,
            defaults,
            run_seed,
            max_samples=self.engine.max_running_requests,
        )
        warn_about_passthrough_names(self.reader.passthrough_schema.names)
        self.summary = RunSummary()
        self._seen_ids: set[str] = set()
        self._pending_rows: list[dict[str, Any]] = []

    def metadata(self) -> dict[str, str]:
        return {
            "batchgen.version": __version__,
            "batchgen.model": self.engine_options.model,
            "batchgen.model_dir": str(self.engine.model_dir),
            "batchgen.dtype": str(self.engine.dtype).removeprefix("torch."),
            "batchgen.logprobs_mode": self.engine_options.logprobs_mode,
            "batchgen.sampling_defaults": json.dumps(asdict(self.defaults)),
            "batchgen.engine_options": json.dumps(asdict(self.engine_options)),
        }

    def run(self) -> RunSummary:
        """Generate every row; the output file is closed and readable when this returns, also after a row error,
        an exception, or a stop signal (``summary.interrupted_by``: the rows in flight are then not written)."""
        with graceful_stop() as stop:
            summary = self._run(stop)
        summary.interrupted_by = stop.name
        return summary

    def _run(self, stop: StopRequest) -> RunSummary:
        start = time.perf_counter()
        writer = open_result_writer(self.out, self.reader.passthrough_schema, self.metadata())
        bar = tqdm(
            total=count_rows(self.reader.path),
            unit="req",
            file=sys.stderr,
            disable=not self.progress,
            dynamic_ncols=True,
        )
        last_flush = time.monotonic()
        try:
            rows = self._requests()
            lookahead = 2 * self.engine.max_running_requests
            input_left = True
            while (input_left or self.engine.has_work()) and stop.signum is None:
                while input_left and len(self.engine.scheduler.waiting) < lookahead:
                    req = next(rows, None)
                    if req is None:
                        input_left = False
                    elif req.finished:
                        self._finish(req, bar)
                    else:
                        self.engine.add(req)
                for req in self.engine.step():
                    self._finish(req, bar)
                if self.progress:
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    stats = self.engine.stats
                    prefill, decode = stats.prefill_tokens / elapsed, stats.decode_tokens / elapsed
                    bar.set_postfix_str(f"prefill {prefill:.0f} tok/s, decode {decode:.0f} tok/s", refresh=False)
                if len(self._pending_rows) >= FLUSH_EVERY_ROWS or time.monotonic() - last_flush > FLUSH_EVERY_SECONDS:
                    writer.write(self._pending_rows)
                    self._pending_rows = []
                    last_flush = time.monotonic()
        finally:
            # Whatever finished is written even when something below fails: no finished row is lost.
            writer.write(self._pending_rows)
            self._pending_rows = []
            writer.close()
            bar.close()
        self.summary.seconds = time.perf_counter() - start
        self.summary.preemptions = self.engine.scheduler.num_retracted
        return self.summary

    def _finish(self, req: Req, bar: tqdm) -> None:
        self._pending_rows.append(result_row(req))
        self.summary.requests += 1
        self.summary.output_tokens += len(req.output_ids)
        if req.sample_index == 0:  # the samples of a row share one prompt, and count as one input row
            self.summary.prompt_tokens += len(req.prompt_ids)
            bar.update(1)

    def _requests(self) -> Iterator[Req]:
        """Requests for the good rows, in input order; bad rows go through the error policy."""
        for order, item in enumerate(self.reader):
            if isinstance(item, RowError):
                self._row_failed(item, str(order), {})
                continue
            source = self.reader.source
            try:
                spec = parse_row(item, source, self.reader.passthrough_schema, block_rows=self.reader.block_rows)
            except RowError as e:
                rid = item.data.get("id")
                self._row_failed(e, str(rid) if rid is not None else str(item.index), {})
                continue
            try:
                if spec.id in self._seen_ids:
                    raise RowError(source, item.line, "id", f"duplicate id '{spec.id}'")
                self._seen_ids.add(spec.id)
                req = self.builder.build(spec, source, order)
            except RowError as e:
                self._row_failed(e, spec.id, spec.passthrough)
                continue
            if req.params.max_new_tokens == 0 and req.params.prompt_logprobs is None:
                req.finish_reason, req.text = "length", ""
                yield from [req.fork(i, None) for i in range(1, req.params.n)]
                req.unforked_samples = 0
            yield req

    def _row_failed(self, error: RowError, rid: str, passthrough: dict[str, Any]) -> None:
        self.summary.errors += 1
        if self.on_error == "skip":
            self._pending_rows.append(error_row(error, rid, passthrough))
            return
        if self.summary.errors <= MAX_PRINTED_ERRORS:
            tqdm.write(f"batchgen: error: {error}", file=sys.stderr)
        elif self.summary.errors == MAX_PRINTED_ERRORS + 1:
            tqdm.write("batchgen: error: more bad rows; only the first 20 are shown", file=sys.stderr)


def check_output_path(dataset: Path, out: Path, overwrite: bool) -> None:
    """Refuse to replace an existing output unless asked, and never write over the input.

    Raises:
        BatchgenError: ``out`` is the dataset, exists without ``overwrite``, or its directory does not exist.
    """
    if out.exists() and dataset.exists() and out.resolve() == dataset.resolve():
        raise BatchgenError(f"{out}: the output file is the input dataset; choose another --out")
    if out.exists() and not overwrite:
        raise BatchgenError(f"{out}: output file exists; pass --overwrite to replace it")
    if not out.parent.exists():
        raise BatchgenError(f"{out}: directory {out.parent} does not exist")


def raise_if_failed(summary: RunSummary, on_error: str) -> None:
    """Under ``--on-error fail`` a run with bad rows ends with an error after writing the good ones."""
    if summary.errors and on_error == "fail":
        raise BatchgenError(f"{summary.errors} bad input rows were left out (see above; --on-error skip writes them)")
