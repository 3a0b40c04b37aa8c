"""``batchgen run --ray`` and ``batchgen.ray.Predictor`` on a local Ray cluster (2 CPUs, no dashboard) started by
this module, with 2 replicas of a random-weight Llama (and of stories260k where ``../shared`` has it): the same
greedy outputs and bad-row handling as a run in one process, every input id exactly once after a replica dies
mid-run and after the driver is SIGKILLed and resumed. Select with ``-m ray``."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install -e '.[ray]'; '.[dev]' has it too)")

import ray  # noqa: E402

from tests.helpers.cli import read_rows, run_args, run_cli  # noqa: E402
from tests.helpers.models import REPO, STORIES, needs_shared  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROWS = 96
LONG_ROWS = 4 * ROWS
# Out of vocabulary: a row the driver's checks pass and a replica refuses when it builds the request.
OOV_ROW = {"id": "oov", "prompt_token_ids": [1, 99999]}
BAD_LINE = '{"id": "broken", "prompt": '  # not JSON: the reader's error, on the driver


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local cluster of 2 CPUs and no dashboard, started in this process; its address."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.ERROR)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def model(random_models: dict[str, Path]) -> Path:
    return random_models["llama"]


def _write_rows(path: Path, count: int) -> Path:
    words = ["cat", "dog", "king", "tree", "boat", "bird", "girl", "star"]
    lines = [
        json.dumps({"id": f"r{i}", "prompt": f"Once upon a time there was a {words[i % 8]}", "max_tokens": 24 + i % 9})
        for i in range(count)
    ]
    lines[7] = BAD_LINE
    lines[60] = json.dumps(OOV_ROW)
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_rows(tmp_path_factory.mktemp("ray") / "rows.jsonl", ROWS)


@pytest.fixture(scope="module")
def long_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """For the runs killed midway: with ROWS rows a fast machine finished the job before the test could kill it."""
    return _write_rows(tmp_path_factory.mktemp("ray") / "long.jsonl", LONG_ROWS)


def _args(dataset: Path, out: Path, model: Path, *extra: str) -> list[str]:
    return run_args(dataset, out, model, "--temperature", "0", "--on-error", "skip", *extra)


def _local_rows(dataset: Path, out: Path, model: Path) -> dict[str, dict[str, Any]]:
    """The rows of a run in this process, without Ray: the reference."""
    code, output = run_cli(_args(dataset, out, model))
    assert code == 0, output
    return read_rows(out)


@pytest.fixture(scope="module")
def local(dataset: Path, model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return _local_rows(dataset, tmp_path_factory.mktemp("local") / "out.arrow", model)


@pytest.fixture(scope="module")
def long_local(long_dataset: Path, model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return _local_rows(long_dataset, tmp_path_factory.mktemp("local") / "long.arrow", model)


def _ray_args(dataset: Path, out: Path, model: Path, address: str, *extra: str) -> list[str]:
    ray_args = ("--ray", "--ray-address", address, "--replicas", "2", "--ray-batch-rows", "16")
    return [*_args(dataset, out, model, *ray_args), *extra]


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:
        return subprocess.Popen([sys.executable, "-m", "batchgen", *args], stdout=f, stderr=subprocess.STDOUT, cwd=REPO)


def _wait_for(condition: Any, what: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s:\n{log.read_text()}"
        time.sleep(0.2)


def _parts(out: Path) -> list[Path]:
    return sorted(out.with_name(out.name + ".partial").glob("part-*.arrow"))


def _assert_same_rows(rows: dict[str, dict[str, Any]], local: dict[str, dict[str, Any]]) -> None:
    """Every id once (read_rows keys by id: the count says none came twice), each row as the local run's."""
    assert sorted(rows) == sorted(local)
    for rid, row in local.items():
        for column in ("output_token_ids", "text", "finish_reason", "error", "prompt_tokens"):
            assert rows[rid][column] == row[column], (rid, column)


def _row_count(out: Path) -> int:
    from batchgen.io.writer import read_results

    return read_results(out).num_rows


def test_same_greedy_rows_and_bad_rows_as_one_process(
    cluster: str, dataset: Path, model: Path, local: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    out = tmp_path / "out.arrow"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, output = run_cli(_ray_args(dataset, out, model, cluster))
    assert code == 0, output
    # Nothing of Ray's own API for the user to act on (Ray 2.60 warns of ray_remote_args, which batchgen passes).
    assert not [w for w in caught if "ray_remote_args" in str(w.message)]
    rows = read_rows(out)
    assert _row_count(out) == ROWS
    _assert_same_rows(rows, local)
    # The unreadable line claims no id: its error row is called null (docs/input-output.md).
    assert rows["null"]["error"] == local["null"]["error"] and rows["null"]["error"].startswith(f"{dataset}:8: ")
    assert "outside the vocabulary" in rows["oov"]["error"] and f"{dataset}:61:" in rows["oov"]["error"]
    assert f"batchgen: {ROWS - 2} rows done, 2 bad rows" in output
    # Reported as a local run reports them, one line each (--on-error fail leaves them out: the same code).
    assert f"batchgen: warning: {rows['oov']['error']} (written as an error row)" in output


def test_every_replica_runs_the_mode_the_output_records(cluster: str, model: Path) -> None:
    """``--deterministic`` left to its default is decided once, where the describing replica loads (the facts the
    output records), and handed to every replica as given, so that no replica on another kind of CPU picks another
    mode for itself."""
    import torch

    from batchgen.job.options import JobOptions
    from batchgen.job.ray_rounds import RayRounds
    from batchgen.kernels.attention import deterministic_by_default
    from batchgen.kernels.switches import KernelSwitches
    from batchgen.loop.options import EngineOptions

    rounds = RayRounds(EngineOptions(model=str(model), device="cpu"), JobOptions(ray=True, ray_address=cluster))
    try:
        expected = deterministic_by_default("auto", torch.device("cpu"), KernelSwitches())
        assert rounds.facts.deterministic is expected
        assert rounds.options.deterministic is expected
    finally:
        rounds.close()


@needs_shared
def test_same_greedy_rows_on_stories260k(cluster: str, dataset: Path, tmp_path: Path) -> None:
    local = _local_rows(dataset, tmp_path / "local.arrow", STORIES)
    out = tmp_path / "out.arrow"
    code, output = run_cli(_ray_args(dataset, out, STORIES, cluster))
    assert code == 0, output
    _assert_same_rows(read_rows(out), local)


def _replicas() -> list[dict[str, Any]]:
    """The live replica actors of the cluster, from its actor table (Ray Data hands out no handle to them)."""
    from ray._private.state import actors

    return [a for a in actors().values() if "RunReplica" in a["ActorClassName"] and a["State"] == "ALIVE"]


def test_exactly_once_after_a_replica_is_killed_mid_run(
    cluster: str, long_dataset: Path, model: Path, long_local: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """A replica killed while the run holds work, as ``ray.kill(replica, no_restart=False)`` kills one: its worker
    process, by SIGKILL (Ray Data hands out no actor handle, and Ray takes none by id from another job). Ray
    restarts it and runs its batch again, and the output holds each id once."""
    out, log = tmp_path / "out.arrow", tmp_path / "run.log"
    proc = _start(_ray_args(long_dataset, out, model, cluster, "--flush-every", "1"), log)
    # Any live replica: waiting for both lost the race on a loaded machine, where the second was still starting when
    # the first had finished every batch.
    _wait_for(lambda: len(_parts(out)) >= 2 and len(_replicas()) >= 1, "finished rows", proc, log)
    victim = _replicas()[0]
    os.kill(victim["Pid"], signal.SIGKILL)
    assert proc.poll() is None and not out.exists(), "the run had ended: the kill was not mid-run"
    assert proc.wait(timeout=600) == 0, log.read_text()
    from ray._private.state import actors

    assert actors()[victim["ActorID"]]["NumRestarts"] >= 1  # Ray restarted the replica
    assert _row_count(out) == LONG_ROWS
    _assert_same_rows(read_rows(out), long_local)


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_exactly_once_after_the_driver_is_stopped_and_resumed(
    cluster: str,
    long_dataset: Path,
    model: Path,
    long_local: dict[str, dict[str, Any]],
    tmp_path: Path,
    stop: signal.Signals,
) -> None:
    """SIGTERM (as SIGINT) stops the run cleanly while the replicas hold batches: no traceback from Ray Data,
    whose iterator the job used to leave waiting while it shut Ray down."""
    out, log = tmp_path / "out.arrow", tmp_path / "run.log"
    proc = _start(_ray_args(long_dataset, out, model, cluster, "--flush-every", "1"), log)
    _wait_for(lambda: len(_parts(out)) >= 3, "three parts", proc, log)
    os.kill(proc.pid, stop)
    code = proc.wait(timeout=120)
    assert not out.exists()
    if stop == signal.SIGTERM:
        printed = log.read_text()
        assert code == 128 + stop, printed
        assert "batchgen: stopped by SIGTERM" in printed, printed
        assert "Traceback" not in printed and "ERROR" not in printed and "WARNING" not in printed, printed
    resumed = [a for a in _ray_args(long_dataset, out, model, cluster) if a != "--overwrite"] + ["--resume"]
    code, output = run_cli(resumed)
    assert code == 0, output
    before = re.search(r"(\d+) rows were done before", output)
    now = re.search(r"batchgen: (\d+) rows done, (\d+) bad rows?", output)
    assert before and now, output
    assert 0 < int(before[1]) < LONG_ROWS
    assert int(before[1]) + int(now[1]) + int(now[2]) == LONG_ROWS  # bad rows written before count as done
    assert _row_count(out) == LONG_ROWS
    _assert_same_rows(read_rows(out), long_local)


def test_predictor_in_a_ray_data_pipeline(
    cluster: str, model: Path, local: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """``map_batches(Predictor)`` keeps the input columns and adds batchgen's, rows as a local run gives them."""
    import pyarrow.parquet as pq

    from batchgen.ray import Predictor

    prompts = {f"r{i}": f"Once upon a time there was a {w}" for i, w in enumerate(["cat", "dog", "king", "tree"])}
    rows = [
        {"id": rid, "prompt": p, "max_tokens": 24 + i, "text": "kept"} for i, (rid, p) in enumerate(prompts.items())
    ]
    options = {"model": str(model), "dtype": "float32", "device": "cpu", "temperature": 0.0}
    out_dir = tmp_path / "out"
    dataset = ray.data.from_items(rows).map_batches(
        Predictor, fn_constructor_kwargs=options, compute=ray.data.ActorPoolStrategy(size=1), num_cpus=1
    )
    dataset.write_parquet(str(out_dir))
    table = pq.read_table(out_dir)
    by_id = {r["id"]: r for r in table.to_pylist()}
    assert sorted(by_id) == sorted(prompts)
    for rid in prompts:
        assert by_id[rid]["output_token_ids"] == local[rid]["output_token_ids"]
        assert by_id[rid]["prompt"] == prompts[rid] and by_id[rid]["input_text"] == "kept"
