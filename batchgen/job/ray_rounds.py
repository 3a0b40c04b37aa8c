"""``batchgen run --ray``'s driver: joins (or starts) a Ray cluster, learns the engine's facts from a replica-sized
task, hands the checked rows to Ray Data in batches, mapped by ``--replicas`` :class:`RunReplica` actors, and
yields their result rows as batches finish.

Exactly once: the rows are read, checked and filtered against the output's finished rows here, on the driver,
which alone writes the partial output (the same part files as a local run: no shared file system across nodes
needed). Ray restarts a dead replica and retries its batch, and only a finished batch's results reach the driver;
a row id that comes back twice all the same is written once (docs/scale-out.md)."""

from __future__ import annotations

import logging
import math
import os
import pickle
import signal
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

from batchgen.environment import replica_environment
from batchgen.errors import BatchgenError
from batchgen.job.options import JobOptions
from batchgen.job.polled_items import poll_every
from batchgen.job.ray_replica import RESULT_COLUMN, ROW_COLUMN, RunReplica, describe_engine
from batchgen.job.request_builder import RequestBuilder
from batchgen.job.rounds import RowResults
from batchgen.job.row_flow import BadRowHandler, CheckedRow
from batchgen.loop.engine import RoundStats
from batchgen.loop.options import EngineOptions

# How often the results yield while no batch finishes.
_POLL_SECONDS = 0.5
# Ray Data's threads that call Ray while a dataset's iteration ends (the executor's scheduling loop, the batches'
# prefetcher), by the names Ray Data gives them; and how long close() waits for them, in seconds.
_RAY_DATA_THREADS = ("StreamingExecutor-", "iter_threaded")
_THREADS_WAIT = 30.0
# Restarts of a dead replica, and reruns of a batch whose replica died, before the job fails.
_RETRIES = 3
T = TypeVar("T")


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        BatchgenError: Ray is not installed.
    """
    try:
        import ray
        import ray.data
    except ImportError:
        raise BatchgenError("--ray needs Ray Data: install batchgen's ray extra (pip install -e '.[ray]')") from None
    return ray


class RayRounds:
    """The rounds of a job on a Ray cluster (see the module).

    Raises (from the constructor):
        BatchgenError: Ray is not installed; ``--ray-address`` names no cluster that answers; the model cannot be
            loaded on the cluster, or the options do not fit it.
    """

    def __init__(self, options: EngineOptions, job: JobOptions) -> None:
        self.ray = import_ray()
        self.options, self.job = options, job
        self._disconnect = self._join(job.ray_address)
        try:
            self._check_resources()
        except BaseException:
            self.close()
            raise
        env = replica_environment()
        self._remote_args: dict[str, Any] = {
            "num_cpus": job.cpus_per_replica,
            "num_gpus": job.gpus_per_replica,
            "runtime_env": {"env_vars": env},
        }
        # max_calls=1: the process that loaded the model exits with the task, rather than keep its memory (a GPU's
        # too) while idle in Ray's pool of workers.
        describe = self.ray.remote(max_calls=1, **self._remote_args)(describe_engine)
        try:
            self.facts = self.ray.get(describe.remote(options))
        except BaseException as e:
            self.close()
            _raise_user_error(e)
            raise
        # The mode the output records, decided where the describing replica loaded; every replica then runs it,
        # whatever its own CPU would choose by default (deterministic_by_default).
        self.options = replace(options, deterministic=self.facts.deterministic)
        self.stats = RoundStats()
        self.preemptions = 0
        self.accept_histogram: Counter[int] = Counter()

    def _join(self, address: str) -> bool:
        """Connect this process to the cluster at ``address`` (``auto``: the one running on this machine, else a
        new local one); whether :meth:`close` disconnects it (not when the caller had connected already)."""
        ray = self.ray
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # batchgen's own bar counts rows across replicas
        logging.getLogger("ray.data").setLevel(logging.WARNING)  # not a line per dataset run
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # "progress bars disabled"
        if ray.is_initialized():
            return False
        quiet: dict[str, Any] = {"logging_level": logging.ERROR}
        try:
            _init_keeping_sigterm(ray, address=address, **quiet)
            joined = f"joined the Ray cluster at {ray.get_runtime_context().gcs_address}"
        except ConnectionError as e:
            # Only where no cluster runs here: a cluster that exists but does not answer is the user's to fix, not
            # one to skip silently for a local one.
            if address != "auto" or "Could not find any running Ray instance" not in str(e):
                raise BatchgenError(f"--ray-address {address}: cannot join the Ray cluster: {e}") from None
            _init_keeping_sigterm(ray, address="local", include_dashboard=False, **quiet)
            joined = f"no Ray cluster runs here: started a local one of {os.cpu_count()} cores"
        print(f"batchgen: {joined}", file=sys.stderr)
        return True

    def _check_resources(self) -> None:
        """Refuse replicas the cluster cannot hold all at once (Ray would wait for them without a word).

        Raises:
            BatchgenError: naming what the replicas need and what the cluster has.
        """
        job, total = self.job, self.ray.cluster_resources()
        for name, flag, each in (
            ("CPU", "--cpus-per-replica", job.cpus_per_replica),
            ("GPU", "--gpus-per-replica", job.gpus_per_replica),
        ):
            need, have = job.replicas * each, total.get(name, 0.0)
            if need > have:
                raise BatchgenError(
                    f"--replicas {job.replicas} x {flag} {each:g} need {need:g} {name}s; the Ray cluster has {have:g}"
                )

    def results(
        self, rows: Iterable[CheckedRow], builder: RequestBuilder, on_bad_row: BadRowHandler, lookahead: int
    ) -> Iterator[list[RowResults]]:
        """See :meth:`batchgen.job.rounds.Rounds.results`: all of ``rows`` are read (and put in the cluster's
        object store) before the first batch runs; a yield per batch finished, and an empty one every half second
        without."""
        ray, job = self.ray, self.job
        pending = [{ROW_COLUMN: pickle.dumps(row)} for row in rows]
        if not pending:
            return
        # At least two batches per replica where the rows allow: every replica gets work, and the last batches
        # are short, so the replicas finish close together. (from_items, not from_arrow: no metadata tasks.)
        batches = max(math.ceil(len(pending) / job.ray_batch_rows), min(len(pending), 2 * job.replicas))
        dataset = ray.data.from_items(pending, override_num_blocks=batches)
        del pending
        replica_args = {
            "options": self.options,
            "defaults": builder.defaults,
            "run_seed": builder.run_seed,
            "chat_template_kwargs": builder.chat_template_kwargs,
            "lookahead": lookahead,
            "threads": max(1, round(job.cpus_per_replica)),
        }
        with warnings.catch_warnings():
            # max_restarts and max_task_retries have no named parameter in Ray 2.60 (the pinned range): they pass
            # as ray_remote_args, which warns that the form goes in Ray 2.64.
            warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
            dataset = self._mapped(dataset, replica_args)
        seen: set[str] = set()
        outputs = poll_every(_POLL_SECONDS, dataset.iter_batches(batch_size=None, batch_format="pyarrow"))
        for out in _user_errors_raised(outputs):
            finished = []
            for blob in out.column(RESULT_COLUMN).to_pylist() if out is not None else []:
                kind, *payload = pickle.loads(blob)
                if kind == "rows":
                    results: RowResults = payload[0]
                    if results[0]["id"] not in seen:
                        seen.add(results[0]["id"])
                        finished.append(results)
                elif kind == "error":
                    error, rid, passthrough = payload
                    if rid not in seen:
                        seen.add(rid)
                        on_bad_row(error, rid, passthrough)
                else:
                    self._add_counts(*payload)
            yield finished

    def _mapped(self, dataset: Any, replica_args: dict[str, Any]) -> Any:
        """``dataset`` mapped by ``--replicas`` :class:`RunReplica` actors made with ``replica_args``."""
        return dataset.map_batches(
            RunReplica,
            fn_constructor_kwargs=replica_args,
            batch_size=None,  # a block is a batch: the unit a replica runs, and Ray retries
            batch_format="pyarrow",
            # One batch at a time per replica: a free replica takes the next batch, none queues behind a busy one.
            compute=self.ray.data.ActorPoolStrategy(size=self.job.replicas, max_tasks_in_flight_per_actor=1),
            # Ray Data's default is to restart and retry without end: a batch that kills every replica it meets (out
            # of memory) would then run forever; the job fails instead, and --resume takes it up.
            max_restarts=_RETRIES,
            max_task_retries=_RETRIES,
            **self._remote_args,
        )

    def _add_counts(self, stats: RoundStats, preemptions: int, accepted: Counter[int]) -> None:
        self.stats += stats
        self.preemptions += preemptions
        self.accept_histogram += accepted

    def close(self) -> None:
        """Disconnect from the cluster (a local one this run started stops); the replicas end with the job. Ray
        Data's threads of a run stopped early finish their shutdown first: one that calls Ray after it is shut
        down ends the process (exit 1, "The core worker has already been shutdown"; seen in CI under load)."""
        if self._disconnect:
            _join_threads(_RAY_DATA_THREADS, _THREADS_WAIT)
            self.ray.shutdown()
            self._disconnect = False


def _join_threads(prefixes: tuple[str, ...], seconds: float) -> None:
    """Wait up to ``seconds`` in all for the threads whose names start with one of ``prefixes`` to end."""
    deadline = time.monotonic() + seconds
    for thread in threading.enumerate():
        if thread.name.startswith(prefixes) and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


def _init_keeping_sigterm(ray: Any, **kwargs: Any) -> None:
    """``ray.init(**kwargs)``, this process's SIGTERM handler kept: Ray's own (``sys.exit``) would end a run
    stopped while it starts, or later, without batchgen's line and exit status (found by a helper). A SIGTERM while
    Ray starts goes to that handler too where it is a function (the command line's, which ends the process)."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(**kwargs)
    except SystemExit as e:  # Ray's handler, which init installs first
        if e.code == signal.SIGTERM and callable(previous):
            previous(signal.SIGTERM, None)
        raise
    finally:
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


def _raise_user_error(error: BaseException) -> None:
    """Raise the :class:`BatchgenError` a replica raised (a model missing on its node), if ``error`` wraps one, as
    the one line it is (Ray wraps it in its own exceptions, with the remote traceback)."""
    seen: BaseException | None = error
    while seen is not None:
        # Ray raises a class of its own that derives from the cause's too: the cause itself is batchgen's.
        if isinstance(seen, BatchgenError) and type(seen).__module__ == BatchgenError.__module__:
            raise seen from None
        seen = getattr(seen, "cause", None) or seen.__cause__


def _user_errors_raised(items: Iterator[T]) -> Iterator[T]:
    """``items``, with a replica's :class:`BatchgenError` raised as itself (:func:`_raise_user_error`)."""
    try:
        yield from items
    except Exception as e:
        _raise_user_error(e)
        raise
