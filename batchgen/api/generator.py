"""``batchgen.Generator``: a model loaded once, generating from rows held in Python (docs/python.md)."""

from __future__ import annotations

import atexit
import contextlib
import inspect
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from collections.abc import Generator as PyGenerator
from typing import Any

from batchgen.api.checks import check_sampling_defaults
from batchgen.api.options import check_option_names, options_of, run_sampling_defaults
from batchgen.api.python_rows import (
    SOURCE,
    call_sampling,
    check_row_fields,
    input_rows,
    parse_python_row,
    python_passthrough,
    with_row_fields,
)
from batchgen.errors import RowError
from batchgen.io.input_options import InputOptions
from batchgen.io.reader import InputRow
from batchgen.io.writer import OUTPUT_COLUMNS
from batchgen.job.options import JobOptions
from batchgen.job.request_builder import RequestBuilder
from batchgen.job.result_rows import error_row
from batchgen.job.row_flow import RowChecks, RowFlow
from batchgen.loop.engine import Engine
from batchgen.loop.options import EngineOptions
from batchgen.loop.req import Req
from batchgen.sampling.plain_values import python_value
from batchgen.sampling.row_fields import ROW_FIELD_KEYWORDS
from batchgen.sampling.sampling_params import SamplingParams
from batchgen.speculative import make_drafter

# A row: a prompt, a message list ({"role", "content"} dicts), prompt token ids, or a row dict as in a JSONL file.
Row = str | list[dict[str, Any]] | list[int] | dict[str, Any]

# Streams not read to their end nor closed: closed at exit, while the modules their cleanup uses are still whole
# (a script ending with a stream open printed "Exception ignored in: <generator object ...>" from the collector).
_OPEN_STREAMS: weakref.WeakSet[PyGenerator[dict[str, Any], None, None]] = weakref.WeakSet()
# At exit, calls running in other threads stop at their next round, and exit waits for them to end: a daemon thread
# the interpreter stopped inside a round's C++ code aborted the process ("terminate called without an active
# exception"). A stream is waited for through its frame; a generate call through this count. At most
# _EXIT_WAIT_SECONDS in all: a stream may be waiting on its caller's rows rather than in a round.
_EXIT_WAIT_SECONDS = 10.0
# The rows a Generator remembers as sampled from its seed, for the warning of a row that draws their noise again.
SAMPLED_IDS_KEPT = 100_000
_EXITING = threading.Event()
_GENERATING = threading.Condition()
_generate_calls = 0


def _until_exit(rounds: Iterator[list[Req]]) -> Iterator[list[Req]]:
    """``rounds``, ended before the next one once the interpreter is exiting."""
    for finished in rounds:
        yield finished
        if _EXITING.is_set():
            return


@contextlib.contextmanager
def _generate_call() -> Iterator[None]:
    """Counts a :meth:`Generator.generate` call while it runs."""
    global _generate_calls
    with _GENERATING:
        _generate_calls += 1
    try:
        yield
    finally:
        with _GENERATING:
            _generate_calls -= 1
            _GENERATING.notify_all()


@atexit.register
def _stop_at_exit() -> None:
    _EXITING.set()
    deadline = time.monotonic() + _EXIT_WAIT_SECONDS
    with _GENERATING:
        _GENERATING.wait_for(lambda: _generate_calls == 0, timeout=_EXIT_WAIT_SECONDS)
    for stream in list(_OPEN_STREAMS):
        try:
            stream.close()
        except ValueError:  # another thread is inside it: it ends there after this round (its cleanup included)
            while inspect.getgeneratorstate(stream) != inspect.GEN_CLOSED and time.monotonic() < deadline:
                time.sleep(0.01)


class Generator:
    """A model loaded once, and its engine, for :meth:`generate` and :meth:`stream` calls on rows held in Python.

    One call runs at a time: a :meth:`stream` that has started must be read to its end or closed before the next
    call.

    Args:
        model: what ``--model`` takes: a model directory, a ``.gguf`` file, a built-in name, a Hugging Face hub id
            or ``random:PRESET``.
        **options: the other engine options (``batchgen run``'s flags) by their Python names:
            ``dtype="float32"``, ``device="cpu"``, ``max_running_requests=64``, ``seed=0`` (the run seed: with it,
            equal calls give equal results; without it each call draws a run seed of its own)...; and
            ``schedule_lookahead``, the rows :meth:`stream` reads ahead (at least twice ``max_running_requests``).

    Raises:
        TypeError: an option that is not an engine option, named.
        BatchgenError: a bad option value (the command line's one-line message, naming the flag), or a model that
            cannot be resolved or loaded.
    """

    def __init__(self, model: str, **options: Any) -> None:
        check_option_names(options, (EngineOptions,), type(self).__name__, also=("schedule_lookahead",))
        self.options = options_of(EngineOptions, options, model=model)
        job = options_of(JobOptions, options)  # schedule_lookahead only: the other names were checked
        job.validate()
        self.engine = Engine(self.options, make_drafter)
        self.lookahead = max(job.schedule_lookahead, 2 * self.engine.max_running_requests)
        self._stream_open = False
        self._sampled_ids: set[str] = set()  # rows finished earlier that sampled with seeds from options.seed

    def generate(
        self,
        rows: Iterable[Row] | Row,
        sampling_params: Mapping[str, Any] | None = None,
        *,
        on_error: str = "fail",
        **sampling: Any,
    ) -> list[dict[str, Any]]:
        """Generate for every row; the results in input order, one dict per sample (a row's ``n`` samples one
        after another, in ``sample_index`` order), as a file row: the columns of
        ``batchgen.io.writer.OUTPUT_COLUMNS`` (``id``, ``text``, ``output_token_ids``, ``finish_reason``...;
        ``top_logprobs`` as ``(token id, logprob)`` pairs), then a dict row's pass-through fields, as given.

        Every row is checked before any is generated.

        Args:
            rows: prompt strings, message lists, token-id lists or row dicts (``id``, ``prompt``/``messages``/
                ``prompt_token_ids``, sampling fields such as ``temperature`` or ``max_tokens``, other fields
                passed through); a row's default id is its 0-based index. A lone row (a string, dict, token-id
                list or message list) is one row.
            on_error: ``fail``: a bad row raises, before anything runs; ``skip``: a bad row gives one result with
                ``finish_reason`` ``"error"`` and the message in ``error``, in its place; ``auto`` (the command
                line's default, skip only for OpenAI Batch output) is ``fail`` here.
            sampling_params: the keywords below as a dict, as SGLang's ``Engine.generate(prompts, {...})``
                takes them.
            **sampling: the sampling defaults of rows that do not set a field (``batchgen run``'s flags by Python
                name: ``max_new_tokens``, ``temperature``, ``top_p``, ``stop``, ``n``..., and the row fields
                ``json_schema``, ``regex``, ``ebnf``, ``choice``, ``logit_bias``, ``allowed_token_ids``,
                ``prompt_logprobs_from``; a row's own
                constraint replaces the call's), the chat template's arguments (``chat_template_kwargs``), and the
                column options of dict rows (``prompt_column``, ``messages_column``, ``prompt_template``,
                ``id_column``: rows of a Hugging Face ``Dataset`` iterate as such dicts).

        Raises:
            TypeError: a keyword that is no sampling default or column option, named (with the batchgen name an
                HF, vLLM or SGLang name stands for); ``sampling_params`` no dict, or one field given twice.
            BatchgenError: a bad sampling default, column option or ``on_error`` (the command line's message); a
                column the options name that the first dict row lacks.
            RowError: ``on_error="fail"`` and a bad row: the first one, as ``rows:LINE: field 'NAME': ...``
                (``LINE`` counts rows from 1).
            RuntimeError: a :meth:`stream` of this generator is still open.
        """
        flow, checks, read = self._flow("generate", on_error, sampling_params, sampling)
        results: list[list[dict[str, Any]]] = []  # per input row (a good row's: empty until it finishes)
        slot_of: dict[str, int] = {}
        bad: list[RowError] = []

        def bad_row(error: RowError, rid: str, passthrough: dict[str, Any]) -> None:
            bad.append(error)
            results.append([_error_result(error, rid, passthrough)])

        requests = []
        for req in flow.requests(checks.checked(read(rows), bad_row), bad_row):
            if req.sample_index == 0:
                slot_of[req.rid] = len(results)
                results.append([])
            requests.append(req)
        if bad and on_error != "skip":  # auto, as for an output of no OpenAI Batch lines, is fail
            raise bad[0]
        with _generate_call():
            try:
                for finished in _until_exit(flow.rounds(iter(requests))):
                    for req in finished:
                        results[slot_of[req.rid]] += flow.result_rows(req)
                        self._note_sampled(req)
            finally:
                self.engine.drop_all()  # after an exception (Ctrl-C): nothing of this call stays in the engine
        return [row for row_results in results for row in row_results]

    def stream(
        self,
        rows: Iterable[Row] | Row,
        sampling_params: Mapping[str, Any] | None = None,
        *,
        on_error: str = "fail",
        **sampling: Any,
    ) -> Iterator[dict[str, Any]]:
        """Generate for every row, yielding each result as its row finishes (finishing order; a row's samples one
        after another): the dicts of :meth:`generate`, matched to their rows by ``id``.

        ``rows`` is read as the engine needs more work (a bounded lookahead: at least twice
        ``max_running_requests``), so it may be a generator over more rows than fit in memory. Closing the stream
        early (``break``, ``.close()``) drops the requests still running.

        Args:
            rows, sampling_params, on_error, sampling: as for :meth:`generate`; but with ``on_error="fail"`` rows
                are not read past a bad row, and it raises after the results of every row before it.

        Raises:
            as :meth:`generate`.
        """
        # Checked here, not at the first result.
        flow, checks, read = self._flow("stream", on_error, sampling_params, sampling)
        results = self._results(flow, checks, read(rows), on_error != "skip")
        _OPEN_STREAMS.add(results)
        return results

    def _results(
        self, flow: RowFlow, checks: RowChecks, rows: Iterator[InputRow | RowError], fail: bool
    ) -> PyGenerator[dict[str, Any], None, None]:
        self._check_no_stream_open()  # another stream may have started since this one was made
        self._stream_open = True
        ready: list[dict[str, Any]] = []

        def bad_row(error: RowError, rid: str, passthrough: dict[str, Any]) -> None:
            if fail:
                raise error
            ready.append(_error_result(error, rid, passthrough))

        try:
            for finished in _until_exit(flow.rounds(flow.requests(checks.checked(rows, bad_row), bad_row))):
                for req in finished:
                    ready += flow.result_rows(req)
                    self._note_sampled(req)
                yield from ready
                ready.clear()
        finally:
            self.engine.drop_all()
            self._stream_open = False

    def _flow(
        self, caller: str, on_error: str, sampling_params: Any, keywords: dict[str, Any]
    ) -> tuple[RowFlow, RowChecks, Callable[[Any], Iterator[InputRow | RowError]]]:
        """A flow of rows through this generator's engine, with the call's sampling defaults (``sampling_params``
        and ``keywords``) as the rows' defaults; the checks of Python rows; and what reads the rows given (with the
        call's column options, and its row fields added to each row).

        Raises:
            TypeError, BatchgenError, RuntimeError: see :meth:`generate`.
        """
        sampling = call_sampling(caller, sampling_params, keywords)
        check_option_names(sampling, (SamplingParams, InputOptions), caller, also=ROW_FIELD_KEYWORDS)
        row_fields = {name: sampling.pop(name) for name in ROW_FIELD_KEYWORDS if name in sampling}
        # numpy's and torch's values as the Python values they hold, as a row's (found by a helper: an array of ids).
        row_fields = {name: python_value(value) for name, value in row_fields.items() if value is not None}
        facts = self.engine.facts()
        check_row_fields(row_fields, facts.vocab_size)
        columns = options_of(InputOptions, sampling)
        columns.validate()
        JobOptions(on_error=on_error).validate()
        defaults = run_sampling_defaults(sampling)
        check_sampling_defaults(defaults, facts)
        self._check_no_stream_open()
        seed = self.options.seed if self.options.seed is not None else secrets.randbits(63)
        builder = RequestBuilder.for_engine(facts, defaults, seed, columns.chat_template_kwargs, self._sampled_ids)
        checks = RowChecks(SOURCE, parse_python_row, python_passthrough)
        return (
            RowFlow(self.engine, builder, self.lookahead),
            checks,
            lambda rows: with_row_fields(input_rows(rows, columns), row_fields),
        )

    def _note_sampled(self, req: Req) -> None:
        """Remember a finished row that sampled with a seed derived from the Generator's (the first
        :data:`SAMPLED_IDS_KEPT`: a loop over the same rows, or over chunks with the default ids, draws them again)."""
        derived = self.options.seed is not None and req.params.seed is None and not req.params.is_greedy
        if derived and req.output_ids and len(self._sampled_ids) < SAMPLED_IDS_KEPT:
            self._sampled_ids.add(req.rid)

    def _check_no_stream_open(self) -> None:
        if self._stream_open:
            raise RuntimeError("a stream of this Generator is still open: read it to its end or close() it first")


def _error_result(error: RowError, rid: str, passthrough: dict[str, Any]) -> dict[str, Any]:
    """The result of a bad row under ``on_error="skip"``: every output column, null but its id and error."""
    return {**dict.fromkeys(OUTPUT_COLUMNS.names), **error_row(error, rid, passthrough)}
