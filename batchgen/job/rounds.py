"""Where a job's rounds run: :class:`LocalRounds` (the engine in this process) or
:class:`batchgen.job.ray_rounds.RayRounds` (engines on a Ray cluster); ``RunJob`` reads checked rows into either and
writes what comes back."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from batchgen.job.request_builder import RequestBuilder
from batchgen.job.row_flow import BadRowHandler, CheckedRow, RowFlow
from batchgen.loop.engine import Engine, EngineFacts, RoundStats
from batchgen.loop.options import EngineOptions
from batchgen.speculative import make_drafter

# The result rows of one input row: its ``n`` samples in ``sample_index`` order.
RowResults = list[dict[str, Any]]


class Rounds(Protocol):
    """Engines that turn checked rows into result rows.

    Attributes:
        facts: the engine's facts (what the output records; what requests are built with).
        stats: the token counts of all rounds so far.
        preemptions: requests retracted so far.
        accept_histogram: speculative decoding's tokens per verify round → rounds.
    """

    facts: EngineFacts

    @property
    def stats(self) -> RoundStats: ...

    @property
    def preemptions(self) -> int: ...

    @property
    def accept_histogram(self) -> Counter[int]: ...

    def results(
        self, rows: Iterable[CheckedRow], builder: RequestBuilder, on_bad_row: BadRowHandler, lookahead: int
    ) -> Iterator[list[RowResults]]:
        """Run ``rows``' requests (built as ``builder`` builds them, with ``lookahead`` rows waiting per engine);
        yield, now and then, the rows finished since the last yield. A row whose request cannot be built goes to
        ``on_bad_row``. The caller may stop between yields; then :meth:`close`."""
        ...

    def close(self) -> None:
        """Give back what the rounds hold (rows still running are dropped)."""
        ...


class LocalRounds:
    """The engine in this process: a yield per round.

    Raises (from the constructor):
        BatchgenError: the model cannot be resolved or loaded, or the options do not fit it.
    """

    def __init__(self, options: EngineOptions) -> None:
        self.engine = Engine(options, make_drafter)
        self.facts = self.engine.facts()

    @property
    def stats(self) -> RoundStats:
        return self.engine.stats

    @property
    def preemptions(self) -> int:
        return self.engine.scheduler.num_retracted

    @property
    def accept_histogram(self) -> Counter[int]:
        return self.engine.scheduler.accept_histogram

    def results(
        self, rows: Iterable[CheckedRow], builder: RequestBuilder, on_bad_row: BadRowHandler, lookahead: int
    ) -> Iterator[list[RowResults]]:
        """See :meth:`Rounds.results`."""
        flow = RowFlow(self.engine, builder, lookahead)
        for finished in flow.rounds(flow.requests(rows, on_bad_row)):
            yield [results for req in finished if (results := flow.result_rows(req))]

    def close(self) -> None:
        """Nothing to give back: the engine lives as long as the job."""
