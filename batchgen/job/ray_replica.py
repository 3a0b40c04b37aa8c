"""The replicas of ``batchgen run --ray``: one engine per Ray actor, each batch of checked rows in, its result rows,
bad rows and round counts out, pickled into one binary column (rows hold any pass-through value; Arrow would need
their schema on the replica)."""

from __future__ import annotations

import pickle
from collections import Counter
from dataclasses import replace
from typing import Any

import pyarrow as pa
import torch

from batchgen.errors import RowError
from batchgen.job.request_builder import RequestBuilder
from batchgen.job.rounds import LocalRounds
from batchgen.job.row_flow import CheckedRow
from batchgen.loop.engine import EngineFacts
from batchgen.loop.options import EngineOptions
from batchgen.sampling.sampling_params import SamplingParams

# The column of a batch sent to a replica (one pickled CheckedRow per row) and of what it sends back.
ROW_COLUMN = "row"
RESULT_COLUMN = "result"


def describe_engine(options: EngineOptions) -> EngineFacts:
    """The facts of the engine ``options`` load, loaded where a replica would be (run as a Ray task with a
    replica's resources, so that device, dtype and kernel switches are a replica's).

    Raises:
        BatchgenError: the model cannot be resolved or loaded, or the options do not fit it.
    """
    return LocalRounds(options).facts


class RunReplica:
    """One engine of ``batchgen run --ray``, a callable class for ``Dataset.map_batches``: each batch (a table
    of one column, ``row``, of pickled :class:`CheckedRow`) is run to its end on the engine, and answered with a
    table of one column, ``result``, whose values are pickled tuples:

    - ``("rows", results)``: a finished row's result rows (its ``n`` samples);
    - ``("error", row_error, rid, passthrough)``: a row whose request could not be built;
    - ``("counts", round_stats, preemptions, accept_histogram)``: what the batch's rounds added (last).

    Args:
        options: the engine's options.
        defaults: the run's sampling defaults.
        run_seed: the run's seed (a row's seed derives from it and the row's id, so a row samples the same on any
            replica).
        chat_template_kwargs: the run's chat template arguments (``--chat-template-kwargs``).
        lookahead: rows waiting in the scheduler.
        threads: torch's CPU threads: the replica's cores.

    Raises (from the constructor):
        BatchgenError: the model cannot be resolved or loaded, or the options do not fit it.
    """

    def __init__(
        self,
        options: EngineOptions,
        defaults: SamplingParams,
        run_seed: int,
        chat_template_kwargs: dict[str, Any],
        lookahead: int,
        threads: int,
    ) -> None:
        torch.set_num_threads(threads)
        self.rounds = LocalRounds(options)
        self.builder = RequestBuilder.for_engine(self.rounds.facts, defaults, run_seed, chat_template_kwargs)
        self.lookahead = lookahead

    def __call__(self, batch: pa.Table) -> pa.Table:
        """The results of one batch (see the class)."""
        rows: list[CheckedRow] = [pickle.loads(blob) for blob in batch.column(ROW_COLUMN).to_pylist()]
        out: list[bytes] = []

        def on_bad_row(error: RowError, rid: str, passthrough: dict[str, Any]) -> None:
            out.append(pickle.dumps(("error", error, rid, passthrough)))

        stats, preemptions = replace(self.rounds.stats), self.rounds.preemptions
        accepted = Counter(self.rounds.accept_histogram)
        for finished in self.rounds.results(rows, self.builder, on_bad_row, self.lookahead):
            out += [pickle.dumps(("rows", results)) for results in finished]
        added = self.rounds.stats - stats
        counts = ("counts", added, self.rounds.preemptions - preemptions, self.rounds.accept_histogram - accepted)
        out.append(pickle.dumps(counts))
        return pa.table({RESULT_COLUMN: pa.array(out, pa.binary())})
