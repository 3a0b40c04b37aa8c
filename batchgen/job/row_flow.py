"""The core that ``batchgen run`` and the Python API share: input rows → checked requests (``Req``) → the engine,
fed with a bounded lookahead → the result rows of finished requests, all samples of a row together."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from batchgen.errors import RowError
from batchgen.io.reader import InputRow
from batchgen.io.row_ids import NO_ID, claims_id, error_row_id
from batchgen.io.rows import RowSpec
from batchgen.job.request_builder import RequestBuilder
from batchgen.job.result_rows import result_row
from batchgen.loop.engine import Engine
from batchgen.loop.req import Req

# Handles a bad row: its error, the id of its error row, and the pass-through fields that error row keeps.
BadRowHandler = Callable[[RowError, str, dict[str, Any]], None]


class CheckedRow(NamedTuple):
    """A row that passed :class:`RowChecks`, as its request is built from it (on this machine or a Ray replica).

    Attributes:
        spec: the row's fields.
        source: the file it came from, for row errors.
        columns: the input's names of fields batchgen read under other names (``InputRow.columns``).
    """

    spec: RowSpec
    source: str
    columns: dict[str, str]


@dataclass
class RowChecks:
    """The checks every input row passes once before its request is built: parsed, its id unique within the run
    (a second row with an id is a bad row), and left out when an earlier run wrote it.

    Attributes:
        source: the input's name in row errors (of a row whose reader names no shard).
        parse: checks one input row (:func:`batchgen.io.rows.parse_row` with the input's pass-through schema).
        bad_passthrough: the pass-through fields a bad row's error row keeps.
        index_ids: whether a row without an id takes its index as its id (not with ``--id-column``, where a row
            must have one): a bad row then holds that id, so that a later row giving it is a duplicate.
        on_claim: called with each row that claims its id (:func:`~batchgen.io.row_ids.claims_id`) first, that id,
            and whether the row goes on to run (a good row not done): the row its output row is made from, whose
            digest the run records for ``--resume``.
    """

    source: str
    parse: Callable[[InputRow], RowSpec]
    bad_passthrough: Callable[[InputRow], dict[str, Any]]
    index_ids: bool = True
    on_claim: Callable[[InputRow, str, bool], None] = lambda row, rid, runs: None
    _seen_ids: set[str] = field(default_factory=set, init=False)
    _index_ids: set[str] = field(default_factory=set, init=False)  # those a row without an id took from its index

    def checked(
        self,
        items: Iterable[InputRow | RowError],
        on_bad_row: BadRowHandler,
        is_done: Callable[[RowSpec], bool] = lambda spec: False,
    ) -> Iterator[CheckedRow]:
        """The good rows of ``items`` not ``is_done`` (written by an earlier run), in input order; each bad row
        (unreadable, failing its checks, a duplicate id) goes to ``on_bad_row`` when it is reached."""
        for item in items:
            if isinstance(item, RowError):  # unreadable: its id is unknown, it claims none (claims_id)
                on_bad_row(item, NO_ID, {})
                continue
            try:
                spec = self.parse(item)
            except RowError as e:
                rid = error_row_id(item)
                if claims_id(item, self.index_ids) and rid not in self._seen_ids:
                    self._seen_ids.add(rid)
                    self.on_claim(item, rid, False)
                on_bad_row(e, rid, self.bad_passthrough(item))
                continue
            indexed = item.data.get("id") is None  # its id is its 0-based index (a null id, or none)
            if spec.id in self._seen_ids:
                error = RowError(item.source or self.source, item.line, "id", self._duplicate(spec.id, indexed))
                on_bad_row(error.named(item.columns), spec.id, spec.passthrough)
                continue
            self._seen_ids.add(spec.id)
            if indexed:
                self._index_ids.add(spec.id)
            runs = not is_done(spec)
            self.on_claim(item, spec.id, runs)
            if runs:
                yield CheckedRow(spec, item.source or self.source, item.columns)

    def _duplicate(self, rid: str, indexed: bool) -> str:
        """The message of a row whose id ``rid`` an earlier row has; where either took it from its index, which
        (found by a user: a pandas id column with a NaN read as "duplicate id '1'" for a row with no id)."""
        if indexed:
            return f"duplicate id '{rid}': the row has no id, and its default, its 0-based index, is another row's"
        if rid in self._index_ids:
            return f"duplicate id '{rid}': an earlier row without an id took it, its 0-based index, as its id"
        return f"duplicate id '{rid}'"


@dataclass
class RowFlow:
    """One pass of checked rows (:class:`RowChecks`) through an engine: each row's request built, fed to the
    engine, and its finished samples turned into result rows.

    The flow keeps each row's pass-through fields until its last sample finishes.

    Attributes:
        engine: the loaded engine; the flow owns its scheduler's requests while it runs.
        builder: builds a row's request (sampling defaults, run seed).
        lookahead: rows read ahead for the scheduler: requests waiting in it are topped up to this many.
    """

    engine: Engine
    builder: RequestBuilder
    lookahead: int
    # Finished samples of rows whose other samples still run: a row's samples are handed out together.
    _samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict, init=False)
    # The pass-through fields of each row in flight, by id, until its last sample is handed out.
    _passthrough: dict[str, dict[str, Any]] = field(default_factory=dict, init=False)

    def requests(self, rows: Iterable[CheckedRow], on_bad_row: BadRowHandler) -> Iterator[Req]:
        """The requests of ``rows``, in their order: one per row, or a row's ``n`` samples when it has nothing to
        generate (``max_new_tokens`` 0, no prompt logprobs: it comes finished, with its other samples); a row whose
        request cannot be built goes to ``on_bad_row`` (its field named as the input names it)."""
        for spec, source, columns in rows:
            try:
                req = self.builder.build(spec, source)
            except RowError as e:
                on_bad_row(e.named(columns), spec.id, spec.passthrough)
                continue
            self._passthrough[spec.id] = spec.passthrough
            if req.params.max_new_tokens == 0 and (req.params.prompt_logprobs is None or req.num_pending == 0):
                # Nothing to generate, and no prompt logprob to compute (none asked, or a one-token prompt).
                req.finish_reason, req.text = "length", ""
                yield from [req.fork(i, None) for i in range(1, req.params.n)]
                req.unforked_samples = 0
            yield req

    def rounds(self, requests: Iterator[Req]) -> Iterator[list[Req]]:
        """Feed ``requests`` to the engine, keeping at most ``lookahead`` of them waiting, and run rounds until
        both are done: yields the requests each round finished (those that came finished first). The caller may
        stop between rounds; requests still in the engine then stay there.

        Raises:
            RowError: the one ``requests`` raised (a bad row that ends the input, ``on_error="fail"``), once the
                requests read before it have finished: the work done on the rows before a bad row is not lost.
        """
        input_left = True
        stopped_by: RowError | None = None
        while input_left or self.engine.has_work():
            finished = []
            while input_left and len(self.engine.scheduler.waiting) < self.lookahead:
                try:
                    req = next(requests, None)
                except RowError as e:
                    stopped_by, req = e, None
                if req is None:
                    input_left = False
                elif req.finished:
                    finished.append(req)
                else:
                    self.engine.add(req)
            finished += self.engine.step()
            yield finished
        if stopped_by is not None:
            raise stopped_by

    def result_rows(self, req: Req) -> list[dict[str, Any]]:
        """The result rows (``batchgen.io.writer.OUTPUT_COLUMNS``, then the row's pass-through fields) that finished
        ``req`` completes: all samples of its row in ``sample_index`` order once the last one finishes, else none."""
        rows = [result_row(req, self._passthrough[req.rid])]
        if req.params.n > 1:
            rows = self._samples.setdefault(req.rid, []) + rows
            self._samples[req.rid] = rows
            if len(rows) < req.params.n:
                return []
            del self._samples[req.rid]
            rows.sort(key=lambda row: row["sample_index"])
        del self._passthrough[req.rid]
        return rows
