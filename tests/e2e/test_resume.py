"""Jobs that never lose work: a run killed at any point (SIGKILL at chosen rows or inside a flush, SIGKILL at a
wall-clock instant, SIGINT, SIGTERM, disk full) resumes with ``--resume`` into an output holding every input row
exactly once, equal to an uninterrupted run's; torn part files and a damaged manifest are detected and dropped."""

from __future__ import annotations

import base64
import errno
import fcntl
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from batchgen.io import partial_output
from batchgen.io.fingerprint import DatasetFingerprint, fingerprint_dataset
from batchgen.io.manifest import decode_manifest, encode_manifest
from batchgen.io.partial_output import PartialOutput, partial_dir
from batchgen.io.reopen import reopen_output
from batchgen.io.writer import read_results
from batchgen.job.status import read_output_status
from batchgen.kernels.switches import KernelSwitches
from batchgen.models.source import triton_fused_ops_requested
from tests.helpers.cli import run_cli, write_jsonl
from tests.helpers.crash_points import AFTER_ROWS, IN_FLUSH, part_write_with_fault
from tests.helpers.fork_runner import Zygote
from tests.helpers.models import perturbed_copy

ROWS = 300
# What a run that cannot have the output because another run writes it says.
WRITING = "another batchgen run is writing this output; wait for it to end"
# Greedy, so an interrupted and resumed run must give the uninterrupted run's tokens; small batches and flushes,
# so that a kill lands somewhere different in the run each time; bad rows are written, so they must be resumed too.
JOB_FLAGS = [
    "--temperature", "0", "--ignore-eos", "--max-running-requests", "8", "--flush-every", "10", "--on-error", "skip",
]  # fmt: skip
Key = tuple[str, Any]


def job_rows(count: int) -> list[dict[str, Any]]:
    """``count`` rows: short prompts, 1-4 new tokens, every 30th with n = 2 (from the 8th), one bad row, one
    duplicate id."""
    rows: list[dict[str, Any]] = []
    for i in range(count):
        row: dict[str, Any] = {
            "id": f"r{i:03d}",
            "prompt_token_ids": [0, 5 + i % 50, 7 + i % 13, 9 + i % 7],
            "max_new_tokens": 1 + i % 4,
            "topic": f"t{i % 3}",
        }
        if i % 30 == 7:
            row["n"] = 2
        if i == count // 3:
            row["temperature"] = -1  # an error row under --on-error skip
        if i == 2 * count // 3:
            row["id"] = f"r{count // 6:03d}"  # a duplicate id: an error row with the same id as a real row
        rows.append(row)
    return rows


COMMON = ["--device", "cpu", "--dtype", "float32", "--no-progress"]


def args(dataset: Path, out: Path, model: Path, *extra: str) -> list[str]:
    """``batchgen run`` arguments, after ``batchgen``."""
    return ["run", str(dataset), "--out", str(out), "--model", str(model), *COMMON, *JOB_FLAGS, *extra]


def by_key(rows: list[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    keyed = {(r["id"], r["sample_index"]): r for r in rows}
    assert len(keyed) == len(rows), "every (id, sample_index) appears exactly once"
    return keyed


def assert_same_rows(got: dict[Key, dict[str, Any]], want: dict[Key, dict[str, Any]]) -> None:
    assert sorted(got, key=str) == sorted(want, key=str)
    for key, row in got.items():
        ref = want[key]
        for column in ("text", "output_token_ids", "finish_reason", "completion_tokens", "topic"):
            assert row.get(column) == ref.get(column), (key, column)
        # An error names the dataset file, which may be a copy: compare what follows "FILE:LINE: ".
        assert (row["error"] or "").split(".jsonl:")[-1] == (ref["error"] or "").split(".jsonl:")[-1], key
        if ref["output_logprobs"] is not None:
            assert row["output_logprobs"] == pytest.approx(ref["output_logprobs"], abs=1e-5), key


def partial_rows(out: Path) -> dict[Key, dict[str, Any]]:
    """The rows of the valid parts of ``out``'s partial output (what a resume keeps)."""
    state = PartialOutput(out).inspect()
    tables = [pa.ipc.open_file(pa.memory_map(str(path))).read_all() for _, path in state.parts]
    return by_key([row for table in tables for row in table.to_pylist()])


def wait_for_parts(out: Path, more_than: int, proc: subprocess.Popen[str] | None = None, timeout: float = 120) -> None:
    """Wait until ``out``'s partial output has more than ``more_than`` part files (a run making progress)."""
    deadline = time.monotonic() + timeout
    directory = partial_dir(out)
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        if directory.is_dir() and sum(1 for p in directory.iterdir() if p.suffix == ".arrow") > more_than:
            return
        time.sleep(0.01)
    raise AssertionError(f"{out}: no progress (exit code {proc.poll() if proc else None})")


# Every run of this module on one thread, in this process and in the ones it starts: the same arithmetic
# everywhere, and on a busy 2-core machine two threads spend most of a tiny model's time waiting on each other.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(random_models: dict[str, Path]) -> Path:
    return random_models["llama"]


@pytest.fixture(scope="module")
def job(model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[Key, dict[str, Any]]]:
    """The 300-row dataset and the rows of its uninterrupted run."""
    work = tmp_path_factory.mktemp("job")
    dataset = write_jsonl(work / "in.jsonl", job_rows(ROWS))
    code, output = run_cli(args(dataset, work / "reference.arrow", model))
    assert code == 0, output
    reference = by_key(read_results(work / "reference.arrow").to_pylist())
    assert len(reference) == ROWS + ROWS // 30  # one more row per n = 2 row
    assert sum(r["finish_reason"] == "error" for r in reference.values()) == 2
    return dataset, reference


# --- the crash harness ------------------------------------------------------------------------------------

# (kind, N) per crash: die after N finished rows, or inside the N-th part write, of that process.
CRASHES = [
    (AFTER_ROWS, 12),
    (IN_FLUSH, 2),
    (AFTER_ROWS, 25),
    (IN_FLUSH, 1),
    (AFTER_ROWS, 9),
    (IN_FLUSH, 3),
    (AFTER_ROWS, 31),
    (IN_FLUSH, 2),
    (AFTER_ROWS, 18),
    (IN_FLUSH, 4),
]


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    runner = Zygote(ONE_THREAD)
    yield runner
    runner.close()


def test_killed_at_many_points_resumes_to_the_uninterrupted_output(
    job: tuple[Path, dict[Key, dict[str, Any]]], model: Path, zygote: Zygote, tmp_path: Path
) -> None:
    """Deaths as by SIGKILL at 10 chosen points (crash_points.py), then SIGKILL from here at 2 wall-clock instants,
    resuming each time. The runs are forked from a zygote (see fork_runner.py): 12 fresh interpreters would spend
    ~45 s importing torch and transformers. ``python -m batchgen`` itself is killed in the signal tests below."""
    dataset, reference = job
    out = tmp_path / "out.arrow"
    done = [0]
    for i, crash in enumerate(CRASHES):
        # The first run starts afresh without --resume; every later one resumes.
        log = tmp_path / f"crash{i}.log"
        pid = zygote.start(args(dataset, out, model, *(["--resume"] if i else [])), {}, log, crash)
        assert zygote.wait(pid) == 137, log.read_text()
        assert not out.exists()  # the final name only ever holds a complete file
        # A death inside a part write leaves that part half-written under its temporary name; one between rows
        # leaves none (the run deleted the one before it when it resumed).
        torn = [p.stat().st_size for p in PartialOutput(out).inspect().damaged]
        if crash[0] == IN_FLUSH:
            assert len(torn) == 1 and torn[0] > 0, torn
        else:
            assert torn == [], torn
        flushed = partial_rows(out)  # readable, and each row is the uninterrupted run's
        assert_same_rows(flushed, {key: reference[key] for key in flushed})
        done.append(len(flushed))
    rng = random.Random(7)
    for i in range(2):
        parts = len(PartialOutput(out).inspect().parts)
        # Two rows at a time (batch sizes may change on resume; the n = 2 rows need two) and a part every 2 rows:
        # the kill comes a little after its first new part, with nearly all of the rows left (a flaky-test audit
        # found 0.4 s of margin with a part every 10).
        run_args = args(dataset, out, model, "--resume", "--max-running-requests", "2", "--flush-every", "2")
        pid = zygote.start(run_args, {}, tmp_path / f"kill{i}.log")
        wait_for_parts(out, parts)
        time.sleep(rng.uniform(0.0, 0.05))
        os.kill(pid, signal.SIGKILL)
        assert zygote.wait(pid) == -signal.SIGKILL
        flushed = partial_rows(out)
        assert_same_rows(flushed, {key: reference[key] for key in flushed})
        done.append(len(flushed))
    # The kills were spread over the run: each resumed run added rows, and the last one left work to do.
    assert done == sorted(done) and done[-1] < len(reference), done
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 0, output
    assert f"batchgen: resuming {out}: " in output
    assert not partial_dir(out).exists()
    assert_same_rows(by_key(read_results(out).to_pylist()), reference)


# --- stop signals -----------------------------------------------------------------------------------------

# Slow rows (160 tokens, 2 at a time) so that a signal lands mid-run; a part every 2 rows. The tests signal once
# the first part is written: with 24 tokens the other 8 rows took a quarter of a second after it here (their
# 96 rounds), which a loaded machine's test process could oversleep; their 640 rounds take over a second and a half.
SLOW_FLAGS = ["--max-running-requests", "2", "--flush-every", "2"]
SLOW_TOKENS = 160


@pytest.fixture(scope="module")
def slow_job(model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[Key, dict[str, Any]]]:
    work = tmp_path_factory.mktemp("slow")
    rows = [{"id": f"s{i}", "prompt_token_ids": [0, 5 + i, 9], "max_new_tokens": SLOW_TOKENS} for i in range(10)]
    dataset = write_jsonl(work / "in.jsonl", rows)
    code, output = run_cli(args(dataset, work / "reference.arrow", model, *SLOW_FLAGS))
    assert code == 0, output
    return dataset, by_key(read_results(work / "reference.arrow").to_pylist())


def _start_slow_run(
    dataset: Path, out: Path, model: Path, preexec_fn: Callable[[], None] | None = None
) -> subprocess.Popen[str]:
    """``python -m batchgen run`` of the slow job in a process of its own (stderr piped), ``preexec_fn`` run in it."""
    return subprocess.Popen(
        [sys.executable, "-m", "batchgen", *args(dataset, out, model, *SLOW_FLAGS)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **ONE_THREAD},
        preexec_fn=preexec_fn,
    )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_stop_signal_flushes_prints_the_resume_command_and_resumes(
    sig: signal.Signals, slow_job: tuple[Path, dict[Key, dict[str, Any]]], model: Path, tmp_path: Path
) -> None:
    dataset, reference = slow_job
    out = tmp_path / "out.parquet"
    proc = _start_slow_run(dataset, out, model)
    wait_for_parts(out, 0, proc)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig.value, stderr
    assert f"stopped by {sig.name}" in stderr and "Traceback" not in stderr
    assert not out.exists()
    flushed = partial_rows(out)
    assert 0 < len(flushed) < len(reference)
    assert_same_rows(flushed, {key: reference[key] for key in flushed})
    # The printed command is the one typed, with --resume: run it.
    [hint] = [line for line in stderr.splitlines() if line.startswith("batchgen: to resume: ")]
    command = shlex.split(hint.removeprefix("batchgen: to resume: "))
    assert command == ["python", "-m", "batchgen", *args(dataset, out, model, *SLOW_FLAGS), "--resume"]
    code, output = run_cli(command[3:])
    assert code == 0, output
    assert_same_rows(by_key(read_results(out).to_pylist()), reference)


def test_a_signal_the_caller_ignores_stays_ignored(
    slow_job: tuple[Path, dict[Key, dict[str, Any]]], model: Path, tmp_path: Path
) -> None:
    """Found by a new user: under nohup (SIGHUP ignored) a SIGHUP stopped the run, which had put its own handler in
    place; a shell's background job ignores SIGINT the same way."""
    dataset, reference = slow_job
    out = tmp_path / "out.arrow"

    def ignore_hangups() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    proc = _start_slow_run(dataset, out, model, ignore_hangups)
    wait_for_parts(out, 0, proc)
    proc.send_signal(signal.SIGHUP)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert_same_rows(by_key(read_results(out).to_pylist()), reference)


# Runs batchgen's entry point with one signal (or two) sent to itself the moment ``run`` has finished its output,
# where its handlers of the rest of the command go in place (a signal then lands there without a race).
_SIGNAL_AFTER_THE_RUN = """
import os, sys
import batchgen.cli.run as cli_run
from batchgen.cli.entry import main
real = cli_run.hold_finished_interrupts
signals = [int(sig) for sig in sys.argv[1].split(",")]
def then_signals():
    real()
    for sig in signals:
        os.kill(os.getpid(), sig)
cli_run.hold_finished_interrupts = then_signals
sys.argv = ["batchgen", *sys.argv[2:]]
main()
"""


@pytest.mark.parametrize(
    ("signals", "code"),
    [([signal.SIGTERM], 0), ([signal.SIGINT], 0), ([signal.SIGTERM, signal.SIGTERM], 128 + signal.SIGTERM)],
    ids=["SIGTERM", "SIGINT", "two"],
)
def test_a_stop_signal_after_the_run_finished_ends_it_as_done(
    signals: list[signal.Signals],
    code: int,
    small_job: tuple[Path, dict[Key, dict[str, Any]]],
    model: Path,
    tmp_path: Path,
) -> None:
    """Found by a helper: a SIGTERM that came as the summary printed said "stopped by SIGTERM while starting" and
    exited 143 over a complete output (a Ctrl-C: 130 and no word). Now one line says the output is written and the
    command ends as done; a second signal ends it at once."""
    dataset, reference = small_job
    out = tmp_path / "out.arrow"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _SIGNAL_AFTER_THE_RUN,
            ",".join(str(int(s)) for s in signals),
            *args(dataset, out, model),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == code, proc.stderr
    name = signals[0].name
    assert f"batchgen: {name} came after the run had finished: its output is written; ending as done" in proc.stderr
    assert "while starting" not in proc.stderr and "Traceback" not in proc.stderr
    assert_same_rows(by_key(read_results(out).to_pylist()), reference)

    # A host that runs the app in its own process keeps its handlers (found by a review: pytest's Ctrl-C was taken).
    def host_handler(signum: int, frame: Any) -> None:
        raise AssertionError("not called")

    previous = {sig: signal.signal(sig, host_handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert run_cli(args(dataset, tmp_path / "again.arrow", model))[0] == 0
        assert [signal.getsignal(sig) for sig in previous] == [host_handler, host_handler]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["run", "--config", "job.yaml"], "batchgen run --config job.yaml --resume"),
        (["run", "d.jsonl", "-o", "o.arrow", "--overwrite"], "batchgen run d.jsonl -o o.arrow --resume"),
        (["run", "--config", "job.yaml", "--resume"], "batchgen run --config job.yaml --resume"),
    ],
)
def test_the_resume_command_is_the_command_with_resume(
    argv: list[str], command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The printed command resumes a run whose config sets overwrite: true too, as --resume replaces the file's
    overwrite (tests/e2e/test_cli.py)."""
    from batchgen.job.resume import resume_command

    monkeypatch.setattr(sys, "argv", ["/usr/bin/batchgen", *argv])
    assert resume_command(Path("d.jsonl"), Path("o.arrow")) == command


def test_stop_message_counts_rows_not_samples(model: Path, zygote: Zygote, tmp_path: Path) -> None:
    """With n = 3 a row is three requests: the stop message counts the rows that were flushed. The signal comes
    after the second part: the 6 rows left must outlast the test's reaction (at 24 tokens they took 0.3 s)."""
    rows = [{"id": f"m{i}", "prompt_token_ids": [0, 5 + i, 9], "max_new_tokens": SLOW_TOKENS, "n": 3} for i in range(8)]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.arrow"
    log = tmp_path / "run.log"
    pid = zygote.start(args(dataset, out, model, "--max-running-requests", "3", "--flush-every", "1"), {}, log)
    wait_for_parts(out, 1)
    os.kill(pid, signal.SIGINT)
    assert zygote.wait(pid) == 130, log.read_text()
    flushed_ids = {rid for rid, _ in partial_rows(out)}
    assert 0 < len(flushed_ids) < len(rows), log.read_text()
    assert f"the {len(flushed_ids)} rows finished in this run are flushed" in log.read_text()


def test_second_sigint_exits_at_once_and_the_run_still_resumes(
    slow_job: tuple[Path, dict[Key, dict[str, Any]]], model: Path, zygote: Zygote, tmp_path: Path
) -> None:
    dataset, reference = slow_job
    out = tmp_path / "out.jsonl"
    log = tmp_path / "run.log"
    pid = zygote.start(args(dataset, out, model, *SLOW_FLAGS), {}, log)
    wait_for_parts(out, 0)
    os.kill(pid, signal.SIGINT)
    time.sleep(0.005)  # two signals at once would be handled as one
    os.kill(pid, signal.SIGINT)
    # Whether the second one came during the loop, the flush or the way out, it ends the run with 130.
    assert zygote.wait(pid) == 130, log.read_text()
    assert "Traceback" not in log.read_text()
    code, output = run_cli(args(dataset, out, model, *SLOW_FLAGS, "--resume"))
    assert code == 0, output
    assert_same_rows(by_key(read_results(out).to_pylist()), reference)


def test_second_signal_handler_exits_with_the_signal_code(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from batchgen.job.interrupts import StopRequest

    def exit_now(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", exit_now)
    request = StopRequest()
    request.handle(signal.SIGTERM, None)
    assert request.name == "SIGTERM"  # the first one only asks the loop to stop
    with pytest.raises(SystemExit) as info:
        request.handle(signal.SIGINT, None)
    assert info.value.code == 130
    assert "batchgen: second SIGINT: stopped at once; rerun with --resume to continue" in capfd.readouterr().err


# --- disk full, torn writes, incomplete rows --------------------------------------------------------------


@pytest.fixture(scope="module")
def small_job(model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[Key, dict[str, Any]]]:
    """40 rows like the big job's (two with n = 2, a bad row, a duplicate id) and its uninterrupted rows."""
    work = tmp_path_factory.mktemp("small")
    dataset = write_jsonl(work / "in.jsonl", job_rows(40))
    code, output = run_cli(args(dataset, work / "reference.arrow", model))
    assert code == 0, output
    return dataset, by_key(read_results(work / "reference.arrow").to_pylist())


def fail_part_write(monkeypatch: pytest.MonkeyPatch, at: int) -> None:
    """Make the ``at``-th part write fail as a full disk does."""

    def disk_full(*_: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(partial_output, "write_part_file", part_write_with_fault(at, disk_full))


def lock_taken(directory: Path) -> bool:
    """Whether a run holds the lock of the partial output ``directory``: another open of its lock file cannot take
    it then (flock's rule between two opens, in one process too)."""
    fd = os.open(directory / "lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def status(dataset: Path, out: Path) -> str:
    """``batchgen status``'s lines; its exit status is 0 for a complete output and 1 while rows remain."""
    code, output = run_cli(["status", str(dataset), str(out)])
    assert code == (0 if output.startswith(f"{out}: complete:") else 1), output
    return output


@pytest.mark.parametrize("suffix", [".arrow", ".parquet", ".jsonl"])
def test_disk_full_is_one_line_keeps_the_flushed_rows_and_resumes(
    suffix: str,
    small_job: tuple[Path, dict[Key, dict[str, Any]]],
    model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dataset, reference = small_job
    out = tmp_path / f"out{suffix}"
    assert status(dataset, out) == f"{out}: not started: 0 of 40 rows done, 40 remaining, 0 errored\n"
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=3)
        code, output = run_cli(args(dataset, out, model))
    assert code == 2
    # Besides the warnings about the job's bad rows (--on-error skip), one line.
    assert [line for line in output.splitlines() if not line.startswith("batchgen: warning: ")] == [
        f"batchgen: error: {partial_dir(out)}: cannot write part 2: No space left on device; the rows flushed "
        "before are kept (fix that, then rerun with --resume)"
    ]
    assert sorted(p.name[:11] for p in partial_dir(out).iterdir()) == [
        "lock",
        "manifest.js",
        "part-000000",
        "part-000001",
    ]
    flushed = partial_rows(out)
    assert_same_rows(flushed, {key: reference[key] for key in flushed})
    done = len({rid for rid, index in flushed if index is not None}) + sum(index is None for _, index in flushed)
    errored = sum(index is None for _, index in flushed)
    assert status(dataset, out).startswith(
        f"{out}: stopped (2 part files in {partial_dir(out)}; no run on this machine holds it): "
        f"{done} of 40 rows done, {40 - done} remaining, {errored} errored"
    )
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 0, output
    assert not partial_dir(out).exists()
    assert_same_rows(by_key(read_results(out).to_pylist()), reference)
    assert status(dataset, out).startswith(f"{out}: complete: 40 of 40 rows done, 0 remaining, 2 errored\n")


def test_progress_bar_counts_bad_rows_and_no_message_shares_its_line(
    small_job: tuple[Path, dict[Key, dict[str, Any]]], model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from batchgen.cli.app import app

    dataset, _ = small_job
    out = tmp_path / "out.arrow"

    def bug(*_: Any) -> None:
        raise RuntimeError("a bug")  # not a BatchgenError: the run prints where the finished rows are

    with_progress = [a for a in args(dataset, out, model) if a != "--no-progress"]
    full = CliRunner().invoke(app, [*with_progress, "--out", str(tmp_path / "full.arrow")])
    assert full.exit_code == 0, full.output
    # The job's two bad rows (--on-error skip) are rows of the input too: the bar ends at 40 of 40.
    assert any(part.startswith("100%") and " 40/40 " in part for part in full.output.split("\r")), full.output
    monkeypatch.setattr(partial_output, "write_part_file", part_write_with_fault(3, bug))
    failed = CliRunner().invoke(app, with_progress)
    assert isinstance(failed.exception, RuntimeError)
    for output in (full.output, failed.output):
        # tqdm redraws with \r: what a terminal shows of a line is what follows its last \r.
        shown = [line.split("\r")[-1] for line in output.split("\n")]
        assert all(line.startswith("batchgen: ") for line in shown if "batchgen: " in line), shown
    assert f"batchgen: the rows finished so far are kept in {partial_dir(out)}; rerun with --resume" in failed.output


def test_disk_full_while_assembling_the_output_keeps_every_row(
    small_job: tuple[Path, dict[Key, dict[str, Any]]], model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dataset, reference = small_job
    out = tmp_path / "out.parquet"

    def disk_full(*_args: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(partial_output, "assemble_output", disk_full)
        code, output = run_cli(args(dataset, out, model))
    assert code == 2
    assert [line for line in output.splitlines() if not line.startswith("batchgen: warning: ")] == [
        f"batchgen: error: {out}: cannot write the output: No space left on device; every row is kept in "
        f"{partial_dir(out)} (fix that, then rerun with --resume)"
    ]
    assert not out.exists() and len(partial_rows(out)) == len(reference)
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 0, output
    assert f"batchgen: resuming {out}: 40 rows were done before" in output
    assert_same_rows(by_key(read_results(out).to_pylist()), reference)


def test_torn_parts_and_a_damaged_manifest_are_dropped_on_resume(
    small_job: tuple[Path, dict[Key, dict[str, Any]]], model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dataset, reference = small_job
    out = tmp_path / "out.arrow"
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=4)
        assert run_cli(args(dataset, out, model))[0] == 2
    state = PartialOutput(out).inspect()
    latest = state.parts[-1][1]
    data = latest.read_bytes()
    kept = len(partial_rows(out)) - pa.ipc.open_file(latest).read_all().num_rows
    # Truncated at any offset, or with a flipped byte, the part is detected and none of its rows is read.
    rng = random.Random(3)
    damaged = [data[:offset] for offset in [0, 1, len(data) - 1, *rng.sample(range(2, len(data) - 1), 12)]]
    damaged.append(data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 1]) + data[len(data) // 2 + 1 :])
    for content in damaged:
        latest.write_bytes(content)
        assert latest in PartialOutput(out).inspect().damaged
        assert len(partial_rows(out)) == kept
    # A crash inside a write leaves a temporary file; a damaged manifest is rebuilt from the parts.
    (partial_dir(out) / "part-000009.tmp").write_bytes(data[:100])
    manifest = partial_dir(out) / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:-30])
    assert "the manifest is damaged" in status(dataset, out)
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 0, output
    assert "manifest.json is damaged; rebuilt from the part files" in output
    assert f"{latest}: torn or damaged write, dropped" in output and "part-000009.tmp: torn" in output
    assert_same_rows(by_key(read_results(out).to_pylist()), reference)


def test_a_part_another_runs_settings_wrote_is_refused_on_resume(
    small_job: tuple[Path, dict[Key, dict[str, Any]]], model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part copied in from a run with other settings (found by a helper: its rows were merged into the output,
    whose metadata named the manifest's settings) stops the resume, naming the part and what differs, as a run
    with other settings does; ``--resume-force`` keeps it with a warning, and without it the rows run again."""
    dataset, reference = small_job
    out, other = tmp_path / "out.arrow", tmp_path / "other.arrow"
    for target, extra in ((out, ("--seed", "7")), (other, ("--seed", "7", "--dtype", "bfloat16"))):
        with monkeypatch.context() as patch:
            fail_part_write(patch, at=3)
            assert run_cli(args(dataset, target, model, *extra))[0] == 2
    foreign = PartialOutput(other).inspect().parts[-1][1]
    digest = foreign.name.split("-")[-1]
    copied = partial_dir(out) / f"part-000050-{digest}"
    shutil.copy(foreign, copied)
    code, output = run_cli(args(dataset, out, model, "--resume"))  # the seed recorded: 7
    assert code == 2, output
    assert output.strip() == (
        f"batchgen: error: {copied}: cannot resume: this part was written with other settings than the partial "
        "output's: dtype 'bfloat16' → 'float32' (delete the part to run its rows again, pass --resume-force to keep "
        "it, or --overwrite to start over)"
    )
    assert "1 part file written with other settings than the partial output's" in status(dataset, out)
    # A part of a run without --seed: its drawn seed is said once, as the seed.
    unseeded = tmp_path / "unseeded.arrow"
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=3)
        assert run_cli(args(dataset, unseeded, model))[0] == 2
    drawn = PartialOutput(unseeded).inspect().parts[-1][1]
    unseeded_copy = partial_dir(out) / f"part-000040-{drawn.name.split('-')[-1]}"  # checked before part 50
    shutil.copy(drawn, unseeded_copy)
    code, output = run_cli(args(dataset, out, model, "--resume"))
    said = re.search(r"part-000040-\w+\.arrow: cannot resume: .* partial output's: seed \d+ → 7 \(delete", output)
    assert code == 2 and said is not None, output
    unseeded_copy.unlink()
    forced = tmp_path / "forced.arrow"
    shutil.copytree(partial_dir(out), partial_dir(forced))
    code, output = run_cli(args(dataset, forced, model, "--resume-force"))
    kept = f"batchgen: warning: {partial_dir(forced) / copied.name}: kept despite: dtype 'bfloat16' → 'float32'"
    assert code == 0 and kept in output.splitlines(), output
    copied.unlink()
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 0, output
    assert_same_rows(by_key(read_results(out).to_pylist()), reference)


def test_parts_a_forced_resume_kept_are_not_refused_by_a_later_resume(
    small_job: tuple[Path, dict[Key, dict[str, Any]]], model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: after ``--resume-force --seed 8`` of a ``--seed 7`` run was stopped in turn, the plain
    ``--resume --seed 8`` its stop message prints refused the seed-7 parts the user had kept. The manifest records
    the parts a forced resume kept, and a later resume takes them as they are."""
    dataset, reference = small_job
    out = tmp_path / "out.arrow"
    for at, extra in ((3, ("--seed", "7")), (2, ("--seed", "8", "--resume-force"))):
        with monkeypatch.context() as patch:
            fail_part_write(patch, at=at)
            code, output = run_cli(args(dataset, out, model, *extra))
            assert code == 2, output
    assert "resuming despite: seed 7 → 8" in output
    code, output = run_cli(args(dataset, out, model, "--seed", "8", "--resume"))
    assert code == 0, output
    assert_same_rows(by_key(read_results(out).to_pylist()), reference)  # greedy rows: either seed gives them


def test_a_row_with_missing_samples_is_generated_again(
    small_job: tuple[Path, dict[Key, dict[str, Any]]], model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should a part hold only some samples of an n = 2 row, the row is not done: all its samples are generated
    again, and the stale one is left out of the output."""
    dataset, reference = small_job
    out = tmp_path / "out.arrow"
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=2)
        assert run_cli(args(dataset, out, model))[0] == 2
    assert ("r037", 1) not in partial_rows(out)
    partial = PartialOutput(out)
    state = partial.inspect()
    assert state.schema is not None
    partial.start(state.schema, state)
    partial.write_part([{**reference[("r037", 1)], "text": "STALE"}], None)
    partial.close()
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 0, output
    assert_same_rows(by_key(read_results(out).to_pylist()), reference)


# --- what a resume accepts --------------------------------------------------------------------------------


def test_resume_refuses_another_job_in_one_line_unless_forced(
    small_job: tuple[Path, dict[Key, dict[str, Any]]],
    model: Path,
    random_models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dataset, reference = small_job
    copy = write_jsonl(tmp_path / "in.jsonl", [json.loads(line) for line in dataset.read_text().splitlines()])
    out = tmp_path / "out.arrow"
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=2)
        assert run_cli(args(copy, out, model))[0] == 2
    where = f"batchgen: error: {partial_dir(out)}: cannot resume: this run differs from the one that wrote it:"
    force = "(pass --resume-force to resume anyway, or --overwrite to start over)"
    other = random_models["qwen2"]
    schema = PartialOutput(out).inspect().schema
    assert schema is not None and schema.metadata is not None
    drawn = schema.metadata[b"batchgen.run_seed"].decode()  # what the rows were seeded from, without --seed
    cases = [
        (args(copy, out, model, "--resume", "--max-new-tokens", "7"), "max_new_tokens 128 → 7"),
        (args(copy, out, other, "--resume"), f"model {str(model)!r} → {str(other)!r}"),
        (
            args(copy, out, model, "--resume", "--temperature", "0.5", "--seed", "3"),
            f"temperature 0.0 → 0.5; seed {drawn} → 3",
        ),
    ]
    for run_args, difference in cases:
        code, output = run_cli(run_args)
        assert code == 2 and output.splitlines() == [f"{where} {difference} {force}"]
    # A row written edited in the dataset since: its parts' digests name it (test_a_partial_output_resumes_...).
    done = sorted(PartialOutput(out).inspect().done.samples)[0]
    rows = [json.loads(line) for line in copy.read_text().splitlines()]
    first = next(i for i, row in enumerate(rows) if row["id"] == done)
    rows[first]["topic"] = "edited"
    write_jsonl(copy, rows)
    code, output = run_cli(["status", str(copy), str(out)])
    changed_note = (
        f"note: 1 row of {partial_dir(out)} changed in {copy} or left it since it was made (--resume refuses it;"
    )
    assert changed_note in output, output
    code, output = run_cli(args(copy, out, model, "--resume"))
    changed = f"the input of 1 row of {partial_dir(out)} changed in {copy} or left it since it was made ('{done}')"
    assert code == 2 and changed in output, output
    code, output = run_cli(args(copy, out, model, "--resume-force", "--max-new-tokens", "7"))
    assert code == 0, output
    assert "warning" in output and "resuming despite" in output and "max_new_tokens" in output
    assert f"{changed}; --resume-force keeps their results" in output
    assert_same_rows(by_key(read_results(out).to_pylist()), reference)  # every row sets its own max_new_tokens


def test_a_partial_output_resumes_from_a_copied_or_grown_dataset(
    small_job: tuple[Path, dict[Key, dict[str, Any]]], model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a new user: a dataset copied elsewhere (the same bytes, a new modification time) blocked --resume, and
    --resume-force then waived every check. Each part records the input digests of its rows, so a resume checks the
    rows written one by one against the dataset as it is now, as it checks a finished output's: from a copy, or with
    rows added at the end, it finishes as an uninterrupted run of that dataset would."""
    dataset, reference = small_job
    copy = tmp_path / "copy.jsonl"
    shutil.copyfile(dataset, copy)
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # whatever the clock's resolution
    grown = write_jsonl(tmp_path / "grown.jsonl", [json.loads(line) for line in dataset.read_text().splitlines()])
    with grown.open("a") as f:
        f.write(json.dumps({"id": "new", "prompt_token_ids": [0, 5, 6], "max_new_tokens": 3}) + "\n")
    assert run_cli(args(grown, tmp_path / "grown.arrow", model))[0] == 0
    for now, want in ((copy, reference), (grown, by_key(read_results(tmp_path / "grown.arrow").to_pylist()))):
        out = tmp_path / f"{now.stem}-out.arrow"
        with monkeypatch.context() as patch:
            fail_part_write(patch, at=2)
            assert run_cli(args(dataset, out, model))[0] == 2
        code, output = run_cli(["status", str(now), str(out)])
        assert code == 1 and "12 of" in output and "changed in" not in output and "no digests" not in output, output
        code, output = run_cli(args(now, out, model, "--resume"))
        assert code == 0 and "resuming despite" not in output and "changed in" not in output, output
        assert_same_rows(by_key(read_results(out).to_pylist()), want)
    # Parts an older batchgen wrote record no digests: the dataset's fingerprint alone is compared, as before.
    out = tmp_path / "older.arrow"
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=2)
        assert run_cli(args(dataset, out, model))[0] == 2
    partial = PartialOutput(out)
    state = partial.inspect()
    assert state.schema is not None and state.input_digests is not None
    rows = pa.concat_tables(pa.ipc.open_file(path).read_all() for _, path in state.parts).to_pylist()
    partial.start(state.schema, None)
    partial.write_part(rows, None)
    partial.close()
    assert PartialOutput(out).inspect().input_digests is None
    code, output = run_cli(["status", str(copy), str(out)])
    assert f"{partial_dir(out)} records no digests of its input rows, so they cannot be checked: --resume" in output
    code, output = run_cli(args(copy, out, model, "--resume"))
    assert code == 2 and "dataset modification time" in output, output


def test_a_reopened_output_stopped_again_resumes_from_a_copied_dataset(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finished output reopened to add a row fixed since takes the input digests it records into its parts: stopped
    while adding rows, it resumes from a copy of the dataset (a new modification time) as from the dataset itself,
    and ends as an uninterrupted run of the fixed dataset."""
    rows = [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i], "max_new_tokens": 2} for i in range(12)]
    rows[3]["temperature"] = -1  # a bad row, left out under --on-error fail
    dataset, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.arrow"
    assert run_cli([*args(dataset, out, model, *SLOW_FLAGS), "--on-error", "fail"])[0] == 3
    del rows[3]["temperature"]
    write_jsonl(dataset, [*rows, *({"id": f"n{i}", "prompt_token_ids": [0, 9, i]} for i in range(6))])
    assert run_cli(args(dataset, tmp_path / "reference.arrow", model))[0] == 0
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=3)  # the reopened rows' part, one part of added rows, then the disk fills
        assert run_cli(args(dataset, out, model, "--resume", *SLOW_FLAGS))[0] == 2
    assert not out.exists() and len(PartialOutput(out).inspect().parts) == 2
    copy = tmp_path / "copy.jsonl"
    shutil.copyfile(dataset, copy)
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    code, output = run_cli(args(copy, out, model, "--resume"))
    assert code == 0 and "changed in" not in output, output
    assert_same_rows(
        by_key(read_results(out).to_pylist()), by_key(read_results(tmp_path / "reference.arrow").to_pylist())
    )


def test_a_row_fixed_then_put_back_is_changed_however_its_output_was_reopened(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a helper: a reopened output's parts took every digest its metadata held, a bad row's among them, and
    a resume checked a row's digest against them all. Its error row fixed and generated, the row put back to its bad
    version then read as unchanged, and the output held both its samples and its error row. Each part now records
    the digest of each of its own rows."""
    rows = [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i], "max_new_tokens": 2} for i in range(8)]
    bad = {**rows[3], "temperature": -1}  # an error row under --on-error skip
    dataset, out = write_jsonl(tmp_path / "in.jsonl", [*rows[:3], bad, *rows[4:]]), tmp_path / "out.arrow"
    assert run_cli(args(dataset, out, model, *SLOW_FLAGS))[0] == 0
    added = [{"id": f"n{i}", "prompt_token_ids": [0, 9, i], "max_new_tokens": 2} for i in range(6)]
    write_jsonl(dataset, [*rows, *added])
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=3)  # the reopened rows' part, one part of generated rows (r3's), then a full disk
        assert run_cli(args(dataset, out, model, "--resume", *SLOW_FLAGS))[0] == 2
    assert "r3" in PartialOutput(out).inspect().done.samples
    write_jsonl(dataset, [*rows[:3], bad, *rows[4:], *added])
    code, output = run_cli(args(dataset, out, model, "--resume"))
    changed = f"the input of 1 row of {partial_dir(out)} changed in {dataset} or left it since it was made ('r3')"
    assert code == 2 and changed in output, output


def test_a_row_kept_by_resume_force_is_named_again_until_the_output_is_finished(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: a reopened output's parts took each row's digest as the dataset held it then, so a row that
    --resume-force kept though its input had changed read as unchanged after a later change, where a partial
    output's part names it again. Both name it until the output is finished."""
    rows = [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i], "max_new_tokens": 2} for i in range(8)]
    dataset, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.arrow"
    assert run_cli(args(dataset, out, model, *SLOW_FLAGS))[0] == 0
    edited = [{**rows[0], "topic": "edited"}, *rows[1:]]
    added = [{"id": f"n{i}", "prompt_token_ids": [0, 9, i], "max_new_tokens": 2} for i in range(6)]
    write_jsonl(dataset, [*edited, *added])
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=3)  # the reopened rows' part, one part of added rows, then a full disk
        code, output = run_cli(args(dataset, out, model, "--resume-force", *SLOW_FLAGS))
        assert code == 2 and "--resume-force keeps their results" in output, output
    os.utime(dataset, ns=(0, dataset.stat().st_mtime_ns + 10**9))
    code, output = run_cli(args(dataset, out, model, "--resume"))
    changed = f"the input of 1 row of {partial_dir(out)} changed in {dataset} or left it since it was made ('r0')"
    assert code == 2 and changed in output, output
    assert run_cli(args(dataset, out, model, "--resume-force"))[0] == 0
    os.utime(dataset, ns=(0, dataset.stat().st_mtime_ns + 10**9))
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 0 and "already complete" in output, output


def test_a_part_recording_other_digests_than_its_rows_names_only_its_rows(tmp_path: Path) -> None:
    """A part whose digests do not match its rows (one count for another) makes its own rows read as changed, not
    every row of the output unchecked (found by a review)."""
    from batchgen.io.input_digests import UNKNOWN_DIGEST
    from batchgen.io.part_file import part_digests

    schema = pa.schema([("id", pa.string()), ("finish_reason", pa.string())])
    rows = [{"id": "a", "finish_reason": "length"}, {"id": "b", "finish_reason": "error"}]
    for recorded, want in ((b"12345678", {"a": b"12345678"}), (b"1234567812345678", {"a": UNKNOWN_DIGEST})):
        table = pa.Table.from_pylist(rows, schema).replace_schema_metadata(
            {"batchgen.input_digests": base64.b64encode(recorded)}
        )
        assert part_digests(table) == want
    assert part_digests(pa.Table.from_pylist(rows, schema)) is None


def test_a_damaged_part_of_a_reopened_output_reruns_only_its_own_rows(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a helper: only the first part of a reopened output recorded digests, so when it was damaged, every
    row of the other parts read as changed after any change to the dataset. Each part's rows have their own."""
    import batchgen.io.reopen as reopen

    rows = [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i], "max_new_tokens": 2} for i in range(12)]
    rows[11]["temperature"] = -1  # left out under --on-error fail
    dataset, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.arrow"
    assert run_cli([*args(dataset, out, model), "--on-error", "fail"])[0] == 3
    del rows[11]["temperature"]
    write_jsonl(dataset, rows)
    assert run_cli(args(dataset, tmp_path / "reference.arrow", model))[0] == 0
    monkeypatch.setattr(reopen, "_PART_ROWS", 4)  # 11 rows reopened into 3 parts
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=4)  # the disk fills as the fixed row's part is written
        assert run_cli(args(dataset, out, model, "--resume"))[0] == 2
    state = PartialOutput(out).inspect()
    assert len(state.parts) == 3 and state.done.count == 11
    first = state.parts[0][1]
    first.write_bytes(first.read_bytes()[:-8])  # torn
    os.utime(dataset, ns=(0, dataset.stat().st_mtime_ns + 10**9))
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 0 and "changed in" not in output and "torn or damaged" in output, output
    assert_same_rows(
        by_key(read_results(out).to_pylist()), by_key(read_results(tmp_path / "reference.arrow").to_pylist())
    )


def test_a_context_length_equal_to_the_models_own_is_the_one_omitted(
    small_job: tuple[Path, dict[Key, dict[str, Any]]], model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a new user: ``--resume --context-length 8192`` on a model of 8,192 positions (what the option
    defaults to: its help text) was refused after a run without it. Either way round it resumes, and a finished
    output is kept; another length is still refused."""
    dataset, reference = small_job
    own = str(json.loads((model / "config.json").read_text())["max_position_embeddings"])
    shorter = str(int(own) - 1)
    for first, then in (([], ["--context-length", own]), (["--context-length", own], [])):
        out = tmp_path / f"out{len(first)}.arrow"
        with monkeypatch.context() as patch:
            fail_part_write(patch, at=2)
            assert run_cli(args(dataset, out, model, *first))[0] == 2
        code, output = run_cli(args(dataset, out, model, "--resume", "--context-length", shorter))
        assert code == 2 and f"context_length {own} → {shorter}" in output
        code, output = run_cli(args(dataset, out, model, "--resume", *then))
        assert code == 0, output
        assert_same_rows(by_key(read_results(out).to_pylist()), reference)
        code, output = run_cli(args(dataset, out, model, "--resume", *then))
        assert code == 0 and "already complete" in output
        code, output = run_cli(args(dataset, out, model, "--resume", "--context-length", shorter))
        assert code == 2 and "is complete, but this run differs" in output


def test_resume_force_with_another_n_says_its_rows_are_generated_again(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a new user: after --n 2 --resume-force, the rows reported "done before" were generated again (a row
    is done with all its n samples), unsaid. The output equals an uninterrupted run with --n 2."""
    rows = [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i], "max_new_tokens": 3} for i in range(30)]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out, whole = tmp_path / "out.arrow", tmp_path / "whole.arrow"
    sampled = ["--temperature", "1.0", "--seed", "5"]
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=2)
        assert run_cli(args(dataset, out, model, *sampled))[0] == 2
    code, output = run_cli(args(dataset, out, model, "--resume-force", "--n", "2", *sampled))
    assert code == 0, output
    assert "resuming despite: n 1 → 2 (rows that take the default n are generated again with n 2)" in output
    assert run_cli(args(dataset, whole, model, "--n", "2", *sampled))[0] == 0
    assert_same_rows(by_key(read_results(out).to_pylist()), by_key(read_results(whole).to_pylist()))


def _interrupted(dataset: Path, out: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Run ``dataset`` into ``out`` until its second flush fails; the ids written."""
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=2)
        assert run_cli(args(dataset, out, model, *SLOW_FLAGS))[0] == 2
    return {rid for rid, _ in partial_rows(out)}


def test_resume_widens_the_columns_for_rows_added_with_fields_of_their_own(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a helper: pass-through types come from every row, so rows added to the dataset with a field of
    their own, an object key more, or floats where integers were, changed the columns, and --resume (even
    --resume-force) refused: only --overwrite, which generates every row again. The written rows now take the
    widened columns (a new field null, an integer as the same double), every row as pyarrow reads its input."""
    old = [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i], "topic": "t", "count": i, "meta": {"a": i}}
           for i in range(12)]  # fmt: skip
    dataset = write_jsonl(tmp_path / "in.jsonl", old)
    out = tmp_path / "out.arrow"
    assert _interrupted(dataset, out, model, monkeypatch)  # some rows written, with the old columns
    new = [{"id": f"n{i}", "prompt_token_ids": [0, 9], "subject": i, "count": i + 0.5, "meta": {"a": 1, "b": "x"}}
           for i in range(3)]  # fmt: skip
    write_jsonl(dataset, old + new)
    code, output = run_cli(args(dataset, out, model, "--resume-force"))
    assert code == 0, output
    table = read_results(out)
    fields = ["topic", "count", "meta", "subject"]
    expected = pa.Table.from_pylist([{name: row.get(name) for name in fields} for row in old + new])
    assert [table.schema.field(name).type for name in fields] == [expected.schema.field(name).type for name in fields]
    by_id = {row["id"]: row for row in table.to_pylist()}
    assert sorted(by_id) == sorted(row["id"] for row in old + new)
    for row, want in zip(old + new, expected.to_pylist(), strict=True):
        assert {name: by_id[row["id"]][name] for name in fields} == want
    # A finished output is reopened with the widened columns as well, by --resume alone (its rows did not change).
    later = [{"id": "m0", "prompt_token_ids": [0, 7], "count": 1, "meta": {"c": [1]}, "tag": True}]
    write_jsonl(dataset, old + new + later)
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 0, output
    fields.append("tag")
    expected = pa.Table.from_pylist([{name: row.get(name) for name in fields} for row in old + new + later])
    table = read_results(out)
    assert [table.schema.field(name).type for name in fields] == [expected.schema.field(name).type for name in fields]
    by_id = {row["id"]: {name: row[name] for name in fields} for row in table.to_pylist()}
    assert [by_id[row["id"]] for row in old + new + later] == expected.to_pylist()


def _finished_then_resumed(old: list[dict[str, Any]], new: list[dict[str, Any]], model: Path, tmp_path: Path) -> Path:
    """Run the rows ``old``, add the rows ``new`` to the dataset, and --resume the finished output; return it."""
    dataset = write_jsonl(tmp_path / "in.jsonl", old)
    out = tmp_path / "out.arrow"
    assert run_cli(args(dataset, out, model))[0] == 0
    write_jsonl(dataset, old + new)
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 0, output
    return out


def test_resume_gives_a_column_of_nulls_the_type_of_the_rows_added(model: Path, tmp_path: Path) -> None:
    """Found by a helper: a field null (or empty lists, or objects of null members) in every row written has a
    ``string`` (``list<string>``, ``struct<a: string>``) column, and rows added with values of another type were
    refused. The written rows hold nulls there, which any type holds: they take the added rows' type (JSON text for
    values of no one type)."""
    old = [{"id": f"r{i}", "prompt_token_ids": [0, 5], "x": None, "l": [], "o": {"a": None}, "j": None}
           for i in range(3)]  # fmt: skip
    new = [
        {"id": "n0", "prompt_token_ids": [0, 6], "x": 5, "l": [1, 2], "o": {"a": 1}, "j": 1},
        {"id": "n1", "prompt_token_ids": [0, 7], "x": 6, "l": [3], "o": {"a": 2}, "j": "two"},
    ]
    table = read_results(_finished_then_resumed(old, new, model, tmp_path))
    typed = ["x", "l", "o"]
    expected = pa.Table.from_pylist([{name: row[name] for name in typed} for row in old + new])
    assert [table.schema.field(name).type for name in typed] == [expected.schema.field(name).type for name in typed]
    by_id = {row["id"]: row for row in table.to_pylist()}
    assert [{name: by_id[row["id"]][name] for name in typed} for row in old + new] == expected.to_pylist()
    assert [by_id[row["id"]]["j"] for row in old + new] == [None, None, None, "1", '"two"']  # JSON text


def test_resume_keeps_each_field_in_the_column_the_rows_written_hold_it_in(model: Path, tmp_path: Path) -> None:
    """Found by a helper: a field named like an output column (``text``) passes through renamed (``input_text``); rows
    added with an ``input_text`` field of their own renamed it ``input_input_text``, and --resume wrote the new rows'
    ``input_text`` into the column the rows written hold ``text`` in. Each field keeps its column; the new one
    takes one more ``input_``. Every row holds its own input's ``text`` and ``input_text``."""
    old = [{"id": f"r{i}", "prompt_token_ids": [0, 5], "text": f"T{i}"} for i in range(2)]
    new = [{"id": "n", "prompt_token_ids": [0, 6], "text": "T2", "input_text": "I2"}]
    rows = {row["id"]: row for row in read_results(_finished_then_resumed(old, new, model, tmp_path)).to_pylist()}
    assert {rid: (row["input_text"], row["input_input_text"]) for rid, row in rows.items()} == {
        "r0": ("T0", None),
        "r1": ("T1", None),
        "n": ("T2", "I2"),
    }


def test_resume_refuses_columns_the_written_rows_cannot_take(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A column written typed whose added values need JSON text, and integers written that a double cannot hold
    exactly (the dataset's own rows edited since, so that its values are doubles), do not combine: one line names
    the column, and only --overwrite starts over."""
    old = [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i], "topic": "t", "n2": 2**53 + 1} for i in range(12)]
    edited = [{**row, "n2": 1} for row in old]
    for now, added, message in (
        (old, {"topic": 5}, "the rows written hold columns of another type (topic (string → JSON text): "),
        (edited, {"n2": 0.5}, "the rows written do not convert to this run's columns (column n2: its values as "),
    ):
        dataset, out = tmp_path / "in.jsonl", tmp_path / f"out{len(message)}.arrow"
        write_jsonl(dataset, old)
        assert _interrupted(dataset, out, model, monkeypatch)
        write_jsonl(dataset, [*now, {"id": "n", "prompt_token_ids": [0, 9], **added}])
        code, output = run_cli(args(dataset, out, model, "--resume-force"))
        last = output.splitlines()[-1]  # after the warning --resume-force gives for the dataset's change
        assert code == 2 and last.startswith(f"batchgen: error: {partial_dir(out)}: cannot resume: {message}"), output
        assert last.endswith("; pass --overwrite to start over")
    # A finished output is checked so before it is reopened: it stays as it was.
    out = tmp_path / "finished.arrow"
    write_jsonl(dataset, old)
    assert run_cli(args(dataset, out, model))[0] == 0
    before = out.read_bytes()
    write_jsonl(dataset, [*edited, {"id": "n", "prompt_token_ids": [0, 9], "n2": 0.5}])
    code, output = run_cli(args(dataset, out, model, "--resume-force"))
    last = output.splitlines()[-1]
    inexact = "the rows written do not convert to this run's columns (column n2: its values as double: "
    assert code == 2 and last.startswith(f"batchgen: error: {out}: cannot resume: {inexact}"), output
    assert out.read_bytes() == before and not partial_dir(out).exists()


def test_an_output_that_records_no_kernel_switches_is_not_refused_over_them() -> None:
    """Outputs written before the switches were recorded resume as before: nothing to compare them with. An output
    that records them is compared (the test above)."""
    from batchgen.job.run_metadata import job_differences

    fingerprint = json.dumps({"size": 1, "mtime_ns": 1, "sample_sha256": "0" * 64})
    older = {"batchgen.model": "m", "batchgen.dtype": "float32", "batchgen.dataset": fingerprint}
    switches = json.dumps({"BATCHGEN_CPU_PREPACK": True})
    now = {**older, "batchgen.kernel_switches": switches}
    assert job_differences(older, now) == []
    other = json.dumps({"BATCHGEN_CPU_PREPACK": False})
    assert job_differences({**older, "batchgen.kernel_switches": other}, now) == ["BATCHGEN_CPU_PREPACK False → True"]


def test_an_output_that_records_no_model_context_length_takes_the_loaded_models() -> None:
    """An output written before the model's own context length was recorded: a resume that loaded the model compares
    an omitted --context-length as that model's (found by a review)."""
    from batchgen.job.run_metadata import job_differences

    fingerprint = json.dumps({"size": 1, "mtime_ns": 1, "sample_sha256": "0" * 64})
    older = {"batchgen.model": "m", "batchgen.dataset": fingerprint}
    older["batchgen.engine_options"] = json.dumps({"seed": 1, "context_length": None})
    now = {**older, "batchgen.model_context_length": "512"}
    for given, differences in ((None, []), (512, []), (511, ["context_length 512 → 511"])):
        now["batchgen.engine_options"] = json.dumps({"seed": 1, "context_length": given})
        assert job_differences(older, now) == differences


def test_an_output_that_records_no_newer_sampling_field_takes_its_default() -> None:
    """An output written before a sampling field existed (include_stop_str_in_output) resumes under a run that
    leaves the field at its default, and is refused under one that sets it."""
    from batchgen.job.run_metadata import job_differences

    fingerprint = json.dumps({"size": 1, "mtime_ns": 1, "sample_sha256": "0" * 64})
    older = {"batchgen.model": "m", "batchgen.dataset": fingerprint}
    older["batchgen.sampling_defaults"] = json.dumps({"max_new_tokens": 4, "temperature": 0.0})
    now = dict(older)
    for include, differences in ((False, []), (True, ["include_stop_str_in_output False → True"])):
        fields = {"max_new_tokens": 4, "temperature": 0.0, "include_stop_str_in_output": include}
        now["batchgen.sampling_defaults"] = json.dumps(fields)
        assert job_differences(older, now) == differences


def test_resume_refuses_other_kernel_switches_as_it_refuses_another_dtype(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel switch can move a result's last bits as the dtype can: the output records the switches, and a
    resume under other ones is refused in the same one line, naming the variable."""
    rows = [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i], "max_new_tokens": 2} for i in range(12)]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.arrow"
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=2)
        assert run_cli(args(dataset, out, model, *SLOW_FLAGS))[0] == 2
    where = f"batchgen: error: {partial_dir(out)}: cannot resume: this run differs from the one that wrote it:"
    force = "(pass --resume-force to resume anyway, or --overwrite to start over)"
    code, output = run_cli([*args(dataset, out, model, "--resume"), "--dtype", "bfloat16"])
    assert (code, output.splitlines()) == (2, [f"{where} dtype 'float32' → 'bfloat16' {force}"])
    monkeypatch.setenv("BATCHGEN_CPU_PREPACK", "off")
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert (code, output.splitlines()) == (2, [f"{where} BATCHGEN_CPU_PREPACK True → False {force}"])
    monkeypatch.delenv("BATCHGEN_CPU_PREPACK")
    # Triton's fused ops turned off on a CPU run the kernels the automatic default runs there (found by a helper:
    # refused as "BATCHGEN_TRITON_FUSED_OPS not given → False").
    assert triton_fused_ops_requested(torch.device("cpu"), KernelSwitches()) is False
    monkeypatch.setenv("BATCHGEN_TRITON_FUSED_OPS", "0")
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 0, output
    assert sorted(row["id"] for row in read_results(out).to_pylist()) == sorted(row["id"] for row in rows)


def test_a_run_whose_cpu_kernels_did_not_build_records_them_off(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a helper: a run whose C++ kernels did not build (no compiler) ran the PyTorch code but recorded the
    kernels on, and its --resume on a machine with them finished the output with the other path's last bits. Now it
    records them off: on the same machine its partial and its finished output resume (a review: the finished one's
    check took the environment's switches, and refused it), a machine with the kernels is refused, one that turns
    them off too resumes."""
    rows = [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i], "max_new_tokens": 2} for i in range(12)]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.arrow"
    with monkeypatch.context() as patch:
        patch.setattr("batchgen.kernels.cpu.build_problem", lambda: "the CPU kernels did not build (no compiler)")
        with monkeypatch.context() as disk:
            fail_part_write(disk, at=2)
            assert run_cli(args(dataset, out, model, *SLOW_FLAGS))[0] == 2
        for _ in range(2):  # the partial output, then the finished one
            code, output = run_cli(args(dataset, out, model, "--resume"))
            assert code == 0, output
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 2 and "is complete, but this run differs from the one that wrote it" in output
    for name in ("BATCHGEN_CPU_ATTENTION_KERNEL", "BATCHGEN_CPU_FUSED_OPS", "BATCHGEN_CPU_HALF_WEIGHT_LINEAR"):
        assert f"{name} False → True" in output
        monkeypatch.setenv(name, "0")
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 0 and "already complete" in output, output


def test_a_model_replaced_at_the_same_path_is_refused(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a helper: a checkpoint retrained in place (or a ``latest`` link moved to another) resumed an output of
    the old one, mixing two models' rows with exit 0. The model's files are fingerprinted: another checkpoint at the
    path is refused by a partial output's resume, a finished one's, and ``status``; a copy of the same files (new
    modification times, as on another machine) is not."""
    here = tmp_path / "model"
    shutil.copytree(model, here)
    rows = [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i], "max_new_tokens": 2} for i in range(12)]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out, done = tmp_path / "out.arrow", tmp_path / "done.arrow"
    assert run_cli(args(dataset, done, here))[0] == 0
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=2)
        assert run_cli(args(dataset, out, here, *SLOW_FLAGS))[0] == 2
    shutil.rmtree(here)
    shutil.copytree(model, here)  # the same files again, every modification time new
    assert status(dataset, done).startswith(f"{done}: complete:")
    shutil.rmtree(here)
    perturbed_copy(model, here)  # another checkpoint at the same path
    changed = "model files changed at the same path: model.safetensors"  # its tokenizer, saved again, too
    for target in (out, done):
        code, output = run_cli(args(dataset, target, here, "--resume"))
        assert code == 2 and changed in output, output
    code, output = run_cli(["status", str(dataset), str(done), "--model", str(here), *COMMON])
    assert code == 1 and changed in output, output


def test_status_of_a_changed_row_and_an_added_one_says_resume_refuses(model: Path, tmp_path: Path) -> None:
    """A helper's trial: one row edited and one appended after the run; status said "finished with rows missing ...
    --resume adds them", and --resume then refused the edited row. The state now says why --resume refuses."""
    rows = [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i], "max_new_tokens": 2} for i in range(4)]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.arrow"
    assert run_cli(args(dataset, out, model))[0] == 0
    rows[1]["prompt_token_ids"] = [0, 40]
    write_jsonl(dataset, [*rows, {"id": "r4", "prompt_token_ids": [0, 9], "max_new_tokens": 2}])
    lines = status(dataset, out).splitlines()
    assert lines[0] == f"{out}: finished from rows changed since: 4 of 5 rows done, 1 remaining, 0 errored"
    assert run_cli(args(dataset, out, model, "--resume"))[0] == 2


def test_a_resume_under_fail_over_a_kept_error_row_exits_3(model: Path, tmp_path: Path) -> None:
    """A helper's trial: a run under --on-error skip wrote a bad row's error row; the dataset touched and resumed
    under --on-error fail, the row still bad, the run said "0 bad rows" and exited 0, where a scheduler reads 3 as
    "bad rows". The error row stays (it is the row's result), and the run exits 3 naming it."""
    rows = [{"id": "a", "prompt_token_ids": [0, 5]}, {"id": "b", "prompt_token_ids": [0, 6], "temperature": -1}]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.arrow"
    assert run_cli(args(dataset, out, model))[0] == 0  # JOB_FLAGS: --on-error skip
    os.utime(dataset, ns=(time.time_ns(), time.time_ns() + 10**9))  # changed: its error rows are read again
    code, output = run_cli([*args(dataset, out, model, "--resume"), "--on-error", "fail"])
    assert (
        code == 3 and "in.jsonl:2: field 'temperature'" in output and "(its error row, written before, stays)" in output
    )
    assert sorted(row["id"] for row in read_results(out).to_pylist()) == ["a", "b"]


def test_another_models_context_is_named_as_the_reason_a_row_holds_other_tokens() -> None:
    """Found by a helper: resuming a stories260k output (512 positions) with SmolLM2 (8,192) blamed the KV pool."""
    from batchgen.job.run_metadata import job_differences

    fingerprint = json.dumps({"size": 1, "mtime_ns": 1, "sample_sha256": "0" * 64})
    base = {"batchgen.dtype": "float32", "batchgen.dataset": fingerprint}
    old = {**base, "batchgen.model": "a", "batchgen.model_context_length": "512", "batchgen.context_length": "512"}
    new = {**base, "batchgen.model": "b", "batchgen.model_context_length": "8192", "batchgen.context_length": "8192"}
    assert job_differences(old, new) == [
        "model 'a' → 'b'",
        "tokens a row may hold 512 → 8192 (the model's context length 512 → 8192)",
    ]
    pool = {**old, "batchgen.context_length": "100"}
    assert job_differences(old, pool)[-1].endswith(
        "(the KV pool, which --max-total-tokens or --mem-fraction sizes, holds fewer tokens than the context)"
    )


def test_a_finished_output_refuses_a_smaller_pool_given_by_flag(model: Path, tmp_path: Path) -> None:
    """A helper's trial: ``--resume --max-total-tokens 100`` of a finished output (rows of up to 256 tokens, the
    random model's context) said "nothing to do", where a partial output's resume refuses the smaller pool; now both
    refuse it, and status says so. A pool that holds the context changes nothing."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt_token_ids": [0, 5], "max_new_tokens": 2}])
    out = tmp_path / "out.arrow"
    assert run_cli(args(dataset, out, model))[0] == 0
    code, output = run_cli(args(dataset, out, model, "--resume", "--max-total-tokens", "100"))
    assert code == 2 and "tokens a row may hold 256 → 100" in output, output
    code, output = run_cli(["status", *args(dataset, out, model, "--max-total-tokens", "100")[1:]])
    assert code == 1 and "finished with other settings" in output and "256 → 100" in output, output
    assert run_cli(["status", *args(dataset, out, model, "--max-total-tokens", "4096")[1:]])[0] == 0
    code, output = run_cli(args(dataset, out, model, "--resume", "--max-total-tokens", "4096"))
    assert code == 0 and "already complete" in output, output


def test_status_of_an_output_from_another_dataset_says_so(
    small_job: tuple[Path, dict[Key, dict[str, Any]]], model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a new user: status counted a finished output's own 40 rows as done for a 3-row dataset, and exited 0."""
    dataset, _ = small_job
    out = tmp_path / "out.arrow"
    assert run_cli(args(dataset, out, model))[0] == 0
    other = write_jsonl(tmp_path / "other.jsonl", [{"id": f"z{i}", "prompt_token_ids": [0, 5]} for i in range(3)])
    lines = status(other, out).splitlines()
    # By id: none of the other dataset's 3 ids has a row in the output, whose 40 rows match none of its rows; as
    # --resume refuses those rows, the state says so first (a helper: "rows missing ... --resume adds them").
    changed = "finished from rows changed since"
    assert lines[0] == f"{out}: {changed}: 0 of 3 rows done, 3 remaining, 0 errored"
    assert lines[1] == f"{out}: note: 40 rows of {out} have an id {other} lacks"
    assert lines[-1].startswith(f"{out}: note: {out} was made from another version of {other}, or from another file")
    assert lines[-1].endswith(f"its rows are matched to {other}'s by id")
    # A partial output, matched to a dataset that keeps one of its rows and adds another: 1 of 2 done.
    partial_out = tmp_path / "partial.arrow"
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=3)
        assert run_cli(args(dataset, partial_out, model))[0] == 2
    flushed = partial_rows(partial_out)
    sampled = {rid for rid, index in flushed if index is not None}
    kept = min(sampled)
    foreign = len(sampled - {kept}) + sum(index is None for _, index in flushed)
    rows = [{"id": rid, "prompt_token_ids": [0, 5]} for rid in (kept, "new")]
    changed = write_jsonl(tmp_path / "changed.jsonl", rows)
    lines = status(changed, partial_out).splitlines()
    assert lines[0].endswith(": 1 of 2 rows done, 1 remaining, 0 errored") and "stopped" in lines[0]
    assert lines[1] == f"{partial_out}: note: {foreign} rows of {partial_out} have an id {changed} lacks"


def test_status_with_dataset_and_out_swapped_asks_whether_they_are(
    small_job: tuple[Path, dict[Key, dict[str, Any]]], model: Path, tmp_path: Path
) -> None:
    """Found by a new user: ``status OUT DATASET`` said only that the dataset's rows are no batchgen output."""
    dataset, _ = small_job
    out = tmp_path / "out.arrow"
    assert run_cli(args(dataset, out, model))[0] == 0
    code, output = run_cli(["status", str(out), str(dataset)])
    assert code == 2 and f"({out} is one: DATASET and OUT swapped? status takes the dataset first)" in output, output
    code, output = run_cli(["status", str(dataset), str(dataset)])  # not swapped: no question
    assert code == 2 and "not a batchgen output" in output and "swapped" not in output, output
    # An output batchgen cannot write is refused as a run refuses it (found by a helper: "not started", exit 1).
    code, output = run_cli(["status", str(dataset), str(tmp_path / "out.csv")])
    assert code == 2 and "out.csv: unsupported output format '.csv'" in output, output
    code, output = run_cli(["status", str(out), str(tmp_path)])  # a dataset directory as OUT: still the question
    assert code == 2 and "DATASET and OUT swapped?" in output, output


def test_status_counts_every_error_row_of_an_id_and_a_finished_output_of_changed_rows_is_not_complete(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: an interrupted run's error rows of one id (a duplicate twice, a bad row and its duplicate)
    counted once; and a finished output whose rows' prompts changed since was "complete", exit 0, which --resume
    refuses."""
    rows = [{"id": "a", "prompt_token_ids": [0, 5]}] * 3 + [{"id": "c", "prompt_token_ids": [0, 5], "top_p": 0}]
    rows += [{"id": "c", "prompt_token_ids": [0, 6]}] + [{"id": f"g{i}", "prompt_token_ids": [0, 7]} for i in range(30)]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.arrow"
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=3)
        assert run_cli(args(dataset, out, model))[0] == 2
    state = PartialOutput(out).inspect()
    written = [r for _, path in state.parts for r in pa.ipc.open_file(pa.memory_map(str(path))).read_all().to_pylist()]
    errors = sum(r["finish_reason"] == "error" for r in written)
    done = len({r["id"] for r in written if r["finish_reason"] != "error"}) + errors
    assert errors >= 3  # a's two duplicates, c's bad row, c's duplicate: in the first part
    assert (
        status(dataset, out)
        .splitlines()[0]
        .endswith(f": {done} of 35 rows done, {35 - done} remaining, {errors} errored")
    )
    assert run_cli(args(dataset, out, model, "--resume"))[0] == 0
    assert status(dataset, out).startswith(f"{out}: complete: 35 of 35 rows done, 0 remaining, 4 errored\n")
    write_jsonl(dataset, [*rows[:5], {"id": "g0", "prompt_token_ids": [0, 8]}, *rows[6:]])  # g0's prompt changed
    lines = status(dataset, out).splitlines()
    assert lines[0] == f"{out}: finished from rows changed since: 35 of 35 rows done, 0 remaining, 4 errored"
    note = f"1 row of {out} changed in {dataset} or left it since it was made (--resume refuses it; --overwrite runs"
    assert f"{out}: note: {note} the dataset again)" in lines
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 2 and "1 row of" in output and "changed in" in output
    # A row gone from the dataset is refused by --resume too (found by a helper: status said complete).
    write_jsonl(dataset, [*rows[:5], *rows[6:]])
    lines = status(dataset, out).splitlines()
    assert lines[0] == f"{out}: finished from rows changed since: 34 of 34 rows done, 0 remaining, 4 errored"
    assert f"{out}: note: {note} the dataset again)" in lines
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 2 and "or left it since it was made ('g0')" in output


def test_status_with_the_run_s_config_compares_its_settings(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a new user: a nightly script asked status whether to run, but status took no --config and looked at
    rows only, so after the config's max-new-tokens changed it said "complete" (exit 0) and the job was skipped,
    where --resume refuses the output. With --config its dataset and out are the defaults, and its settings are
    compared as --resume compares them."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt_token_ids": [0, 5]} for i in ("a", "b")])
    out = tmp_path / "out.arrow"
    config = tmp_path / "job.yaml"
    config.write_text(f"dataset: {dataset}\nout: {out}\nmodel: {model}\ndevice: cpu\nmax-new-tokens: 3\n")
    assert run_cli(["run", "--config", str(config), "--no-progress"])[0] == 0
    code, output = run_cli(["status", "--config", str(config)])
    assert (code, output) == (0, f"{out}: complete: 2 of 2 rows done, 0 remaining, 0 errored\n")
    config.write_text(config.read_text().replace("max-new-tokens: 3", "max-new-tokens: 2"))
    code, output = run_cli(["status", "--config", str(config)])
    note = f"{out}: note: {out} was made with other settings than the run's (max_new_tokens 3 → 2): --resume"
    assert code == 1 and output.splitlines() == [
        f"{out}: finished with other settings: 2 of 2 rows done, 0 remaining, 0 errored",
        f"{note} refuses it unless --resume-force",
    ]
    code, output = run_cli(["run", "--config", str(config), "--no-progress", "--resume"])
    assert code == 2 and "max_new_tokens 3 → 2" in output
    # With resume-force in the config, --resume keeps it: so does status (found by a review).
    forced = tmp_path / "forced.yaml"
    forced.write_text(config.read_text() + "resume-force: true\n")
    code, output = run_cli(["status", "--config", str(forced)])
    assert (code, output.splitlines()) == (
        0,
        [f"{out}: complete: 2 of 2 rows done, 0 remaining, 0 errored", f"{note}-force keeps it"],
    )
    assert run_cli(["run", "--config", str(forced), "--no-progress", "--resume"])[0] == 0
    # A config value that is no path is one line, exit 2 (it was a traceback and exit 1).
    forced.write_text("dataset: 5\nout: x.arrow\n")
    code, output = run_cli(["status", "--config", str(forced)])
    assert (code, output) == (
        2,
        f"batchgen: error: {forced}: option 'dataset': takes text, got 5 (quote a value meant as text)\n",
    )
    assert run_cli(["status", str(dataset), str(out)])[0] == 0  # without the config: rows only
    code, output = run_cli(["status"])
    assert (code, output) == (
        2,
        "batchgen: error: status needs DATASET and OUT, as arguments or as the keys of its --config\n",
    )
    # An interrupted run's partial output is compared too: --resume would refuse to continue it.
    write_jsonl(dataset, [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i]} for i in range(30)])
    partial_out = tmp_path / "partial.arrow"
    config.write_text(
        config.read_text().replace(str(out), str(partial_out)) + "flush-every: 10\nmax-running-requests: 8\n"
    )
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=2)
        assert run_cli(["run", "--config", str(config), "--no-progress"])[0] == 2
    config.write_text(config.read_text().replace("max-new-tokens: 2", "max-new-tokens: 1"))
    code, output = run_cli(["status", "--config", str(config)])
    assert code == 1 and "stopped" in output.splitlines()[0]
    assert output.splitlines()[-1] == (
        f"{partial_out}: note: {partial_out} was made with other settings than the run's (max_new_tokens 2 → 1): "
        "--resume refuses it unless --resume-force"
    )


def test_status_takes_the_run_s_command_line(model: Path, tmp_path: Path) -> None:
    """Found by a review: status compared settings only through --config, so a nightly script whose run takes flags
    could not ask it whether `run --resume` with them has work to do, and `status --config job.yaml OUT2` read OUT2
    as the dataset. The run's command line with `status` for `run` is now status's, --out and all."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt_token_ids": [0, 5]} for i in ("a", "b")])
    out = tmp_path / "out.arrow"
    flags = [str(dataset), "--out", str(out), "--model", str(model), "--device", "cpu", "--no-progress"]
    assert run_cli(["run", *flags, "--max-new-tokens", "3"])[0] == 0
    complete = f"{out}: complete: 2 of 2 rows done, 0 remaining, 0 errored"
    assert run_cli(["status", *flags, "--max-new-tokens", "3", "--resume"]) == (0, complete + "\n")
    code, output = run_cli(["status", *flags, "--max-new-tokens", "2", "--resume"])
    note = f"{out}: note: {out} was made with other settings than the run's (max_new_tokens 3 → 2): --resume"
    assert (code, output.splitlines()) == (
        1,
        [f"{out}: finished with other settings: 2 of 2 rows done, 0 remaining, 0 errored", f"{note} refuses it "
         "unless --resume-force"],
    )  # fmt: skip
    assert run_cli(["run", *flags, "--max-new-tokens", "2", "--resume"])[0] == 2  # as status said
    code, output = run_cli(["status", *flags, "--max-new-tokens", "2", "--resume", "--resume-force"])
    assert (code, output.splitlines()) == (0, [complete, f"{note}-force keeps it"])
    # `status DATASET OUT` looks at rows only; `--out OUT` is the run's command line, whose defaults differ here (found
    # by a helper: `status d --out o || run d --out o --resume` skipped a run that --resume refuses).
    assert run_cli(["status", str(dataset), str(out)]) == (0, complete + "\n")
    code, output = run_cli(["status", str(dataset), "--out", str(out)])
    assert code == 1 and "max_new_tokens 3 → 128)" in output
    assert run_cli(["run", str(dataset), "--out", str(out), "--model", str(model), "--resume"])[0] == 2
    # An option a run refuses is refused (found by a helper: status answered 0 or 1).
    for bad in (["--on-error", "bogus"], ["--temperature", "-1"], ["--resume", "--overwrite"]):
        code, output = run_cli(["status", *flags, "--max-new-tokens", "3", *bad])
        assert code == 2 and output.startswith("batchgen: error: --"), (bad, output)
    csv = tmp_path / "out.csv"  # an output a run refuses
    code, output = run_cli(["status", str(dataset), "--out", str(csv), "--model", str(model)])
    assert code == 2 and output.startswith(f"batchgen: error: {csv}: ")
    nowhere = tmp_path / "no" / "out.arrow"
    code, output = run_cli(["status", str(dataset), "--out", str(nowhere), "--model", str(model)])
    assert (code, output) == (2, f"batchgen: error: {nowhere}: directory {nowhere.parent} does not exist\n")
    # OUT as the argument or as --out, not both.
    code, output = run_cli(["status", str(dataset), str(out), "--out", str(tmp_path / "other.arrow")])
    assert (code, output) == (2, f"batchgen: error: OUT is given twice: {out} and --out {tmp_path / 'other.arrow'}\n")
    # A config's out gives way to --out; status's own --out is no config key.
    config = tmp_path / "job.yaml"
    config.write_text(f"dataset: {dataset}\nout: {out}\nmodel: {model}\ndevice: cpu\nmax-new-tokens: 3\n")
    assert run_cli(["status", "--config", str(config)]) == (0, complete + "\n")
    other = tmp_path / "other.arrow"
    code, output = run_cli(["status", "--config", str(config), "--out", str(other)])
    assert (code, output) == (1, f"{other}: not started: 0 of 2 rows done, 2 remaining, 0 errored\n")
    config.write_text(config.read_text() + "out-flag: x.arrow\n")
    code, output = run_cli(["status", "--config", str(config)])
    assert code == 2 and "unknown option 'out-flag'" in output


def test_status_with_resume_force_still_sends_error_rows_of_a_changed_dataset_to_resume(
    model: Path, tmp_path: Path
) -> None:
    """Found by a review: with resume-force in the config, status called an output complete (exit 0) when the dataset
    had changed and the output held error rows, so a nightly `status || run --resume` skipped the run; but --resume
    (with --resume-force too) reads the dataset again for those rows, and generates the ones fixed since."""
    rows = [{"id": "a", "prompt_token_ids": [0, 5]}, {"id": "b", "prompt_token_ids": [0, 6], "top_p": 0}]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.arrow"
    config = tmp_path / "job.yaml"
    settings = "device: cpu\nmax-new-tokens: 2\non-error: skip\nresume-force: true\n"
    config.write_text(f"dataset: {dataset}\nout: {out}\nmodel: {model}\n{settings}")
    assert run_cli(["run", "--config", str(config), "--no-progress"])[0] == 0
    code, output = run_cli(["status", "--config", str(config)])
    assert (code, output) == (0, f"{out}: complete: 2 of 2 rows done, 0 remaining, 1 errored\n")
    write_jsonl(dataset, [rows[0], {"id": "b", "prompt_token_ids": [0, 6]}])  # b fixed
    code, output = run_cli(["status", "--config", str(config)])
    assert code == 1 and output.splitlines()[0] == (
        f"{out}: finished from rows changed since: 2 of 2 rows done, 0 remaining, 1 errored"
    )
    assert f"{out}: note: the dataset changed: --resume checks {out}'s 1 error row again" in output.splitlines()
    assert run_cli(["run", "--config", str(config), "--no-progress", "--resume"])[0] == 0
    rows_now = read_results(out).to_pylist()
    assert [(r["id"], r["finish_reason"] != "error") for r in rows_now] == [("a", True), ("b", True)]
    code, output = run_cli(["status", "--config", str(config)])
    assert (code, output) == (0, f"{out}: complete: 2 of 2 rows done, 0 remaining, 0 errored\n")


def test_a_duplicate_id_left_out_is_not_taken_for_complete_by_resume(model: Path, tmp_path: Path) -> None:
    """Found by a helper: a duplicate id that --on-error fail left out made status say 1 row remains, while --resume
    said "already complete; nothing to do" (exit 0) without a word of the bad row. --resume now reads the dataset
    again, names the row and exits 3, as status's exit 1 foretells."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"id": "ok", "prompt_token_ids": [0, 5]}] * 2)
    out = tmp_path / "out.arrow"
    code, output = run_cli(args(dataset, out, model, "--on-error", "fail"))
    assert code == 3 and "field 'id': duplicate" in output
    assert status(dataset, out).startswith(f"{out}: finished with rows missing: 1 of 2 rows done, 1 remaining")
    code, output = run_cli(args(dataset, out, model, "--on-error", "fail", "--resume"))
    assert code == 3 and "field 'id': duplicate" in output and "1 bad input row left out" in output
    assert read_results(out).column("id").to_pylist() == ["ok"]


def test_a_kv_pool_that_holds_fewer_tokens_a_row_is_refused_on_resume(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A helper's trial: a resume with --max-total-tokens below the context length (which the pool then caps) was
    accepted and cut the rows it generated short of the uninterrupted run's. Rows of 100 + 40 tokens, a model of
    256 positions: a pool of 120 tokens holds fewer than a row needs."""
    rows = [{"id": f"r{i}", "prompt_token_ids": [0] + [5 + i] * 99, "max_new_tokens": 40} for i in range(6)]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.arrow"
    flags = ("--ignore-eos", "--max-running-requests", "1", "--flush-every", "1")
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=3)
        assert run_cli(args(dataset, out, model, *flags))[0] == 2
    code, output = run_cli(args(dataset, out, model, *flags, "--resume", "--max-total-tokens", "120"))
    assert code == 2 and "tokens a row may hold 256 → 120 (the KV pool" in output, output
    code, output = run_cli(args(dataset, out, model, *flags, "--resume", "--max-total-tokens", "300"))
    assert code == 0, output  # a pool that holds a whole row changes only the speed
    assert {r["completion_tokens"] for r in read_results(out).to_pylist()} == {40}


def test_the_run_seed_an_unseeded_run_drew_is_its_seed(model: Path, tmp_path: Path) -> None:
    """Found by a helper: a script that pinned the run seed an unseeded run recorded was refused ("seed not given →
    N"), though rows are seeded from the run seed alone: a run given it as --seed writes the same sampled rows. A
    run resumed without --seed keeps it too, and another --seed is shown against it (a new user's trial)."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt_token_ids": [0, 5 + i]} for i in range(3)])
    out = tmp_path / "out.arrow"
    run = ["run", str(dataset), "--out", str(out), "--model", str(model), *COMMON, "--max-new-tokens", "4"]
    assert run_cli(run)[0] == 0  # temperature 1.0, no seed: a random run seed
    table = read_results(out)
    seed = (table.schema.metadata or {})[b"batchgen.run_seed"].decode()
    assert run_cli(["status", *run[1:], "--seed", seed])[0] == 0
    assert run_cli([*run, "--resume", "--seed", seed]) == (0, f"batchgen: {out} is already complete; nothing to do\n")
    code, output = run_cli([*run, "--resume", "--seed", str(int(seed) + 1)])
    assert code == 2 and f"seed {seed} → {int(seed) + 1}" in output  # the seed the rows had, not "not given"
    seeded = tmp_path / "seeded.arrow"
    assert run_cli([*run[:3], str(seeded), *run[4:], "--seed", seed])[0] == 0
    tokens = {row["id"]: row["output_token_ids"] for row in read_results(seeded).to_pylist()}
    assert tokens == {row["id"]: row["output_token_ids"] for row in table.to_pylist()}


def test_status_says_when_a_run_is_writing_the_output(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a helper: while a run went on, status said only "in progress", and the `run --resume` a script ran
    after it failed (exit 2, "another batchgen run is writing this output"). Status now says a run holds it."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i]} for i in range(30)])
    out = tmp_path / "out.arrow"
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=2)
        assert run_cli(args(dataset, out, model))[0] == 2
    note = f"{out}: note: a run is writing it now: --resume refuses it until that run ends"
    assert note not in status(dataset, out).splitlines()
    assert status(dataset, out).startswith(f"{out}: stopped (")  # not "in progress" (a helper's trial after Ctrl-C)
    fd = os.open(partial_dir(out) / "lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running batchgen holds it
        assert note in status(dataset, out).splitlines()
        assert status(dataset, out).startswith(f"{out}: in progress (")
        code, output = run_cli(args(dataset, out, model, "--resume"))
        assert code == 2 and "another batchgen run is writing this output" in output
    finally:
        os.close(fd)
    assert note not in status(dataset, out).splitlines()
    assert run_cli(args(dataset, out, model, "--resume"))[0] == 0


def test_resume_holds_the_lock_from_before_it_reads_the_partial_output(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a helper: --resume read an interrupted run's partial output, and reopened a finished output into
    one, without its lock, which it took only to write; meanwhile status said no run was writing it. Whenever the
    partial output is read, another open of its lock file must now find it taken (flock's rule between two opens)."""
    rows = [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i]} for i in range(12)]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows[:8])
    out = tmp_path / "out.arrow"
    assert run_cli(args(dataset, out, model))[0] == 0
    write_jsonl(dataset, rows)  # the finished output now lacks rows: --resume reopens it
    taken: list[bool] = []
    inspect = PartialOutput.inspect

    def inspect_and_probe(self: PartialOutput) -> Any:
        taken.append(lock_taken(self.dir))
        return inspect(self)

    monkeypatch.setattr(PartialOutput, "inspect", inspect_and_probe)
    assert run_cli(args(dataset, out, model, "--resume"))[0] == 0
    assert taken == [True]
    # Reopened once more, and stopped by a full disk after the reopened part: then a partial output to resume.
    write_jsonl(dataset, [*rows, {"id": "r12", "prompt_token_ids": [0, 17]}])
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=2)
        assert run_cli(args(dataset, out, model, "--resume"))[0] == 2
    assert partial_dir(out).is_dir() and not out.exists()
    assert run_cli(args(dataset, out, model, "--resume"))[0] == 0
    assert taken == [True, True, True]
    assert sorted(row["id"] for row in read_results(out).to_pylist()) == sorted(f"r{i}" for i in range(13))


def test_resume_leaves_the_parts_of_a_run_reopening_the_output_alone(model: Path, tmp_path: Path) -> None:
    """While a run reopens a finished output that lacks rows, the output and its partial output are both there,
    the parts holding every finished row until the run removes the output. A second --resume then took the partial
    output for a crash's leftover and deleted it, and the rows were lost once the first removed the output. It must
    find the lock taken and stop, leaving both alone."""
    rows = [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i]} for i in range(6)]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows[:4])
    out = tmp_path / "out.arrow"
    assert run_cli(args(dataset, out, model))[0] == 0
    write_jsonl(dataset, rows)
    table = read_results(out)
    partial = PartialOutput(out)  # the first run, half way through reopening: its parts written, the output there
    partial.start(table.schema, None)
    partial.write_part(table.to_pylist(), None)
    try:
        code, output = run_cli(args(dataset, out, model, "--resume"))
        assert code == 2 and output.endswith(f"{partial_dir(out)}: {WRITING}\n")
        assert PartialOutput(out).inspect().done.count == 4 and read_results(out) == table
    finally:
        partial.close()
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 0, output
    assert sorted(row["id"] for row in read_results(out).to_pylist()) == [f"r{i}" for i in range(6)]


def test_a_finishing_run_removes_its_partial_output_under_its_lock(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a helper: a run that had put OUT in place released its lock before removing OUT.partial/, and a
    second run that took the lock in between had its own parts removed. The lock must be taken when it removes them."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i]} for i in range(4)])
    out = tmp_path / "out.arrow"
    taken: list[bool] = []
    remove = partial_output.remove_partial_dir

    def probe_then_remove(directory: Path) -> None:
        taken.append(lock_taken(directory))
        remove(directory)

    monkeypatch.setattr(partial_output, "remove_partial_dir", probe_then_remove)
    assert run_cli(args(dataset, out, model))[0] == 0
    assert taken == [True] and not partial_dir(out).exists() and len(read_results(out)) == 4


def test_status_agrees_with_resume_on_a_changed_dataset_s_error_rows_and_on_outputs_without_digests(
    model: Path, tmp_path: Path
) -> None:
    """Found by a helper: status said complete (exit 0) where --resume had work or refused: an error row of a row
    removed since (--resume reads the dataset again and leaves it out), and an output that records no digests of its
    inputs (an older batchgen's, or a run of more rows than it keeps digests for) after its dataset changed."""
    rows = [{"id": "a", "prompt_token_ids": [0, 5]}, {"id": "b", "prompt_token_ids": [0, 6], "top_p": 0}]
    dataset = write_jsonl(tmp_path / "in.jsonl", [*rows, {"id": "c", "prompt_token_ids": [0, 7]}])
    out = tmp_path / "out.arrow"
    run = ["run", str(dataset), "--out", str(out), "--model", str(model), *COMMON, "--on-error", "skip"]
    assert run_cli(run)[0] == 0
    write_jsonl(dataset, [rows[0], {"id": "c", "prompt_token_ids": [0, 7]}])  # the bad row b removed
    code, output = run_cli(["status", *run[1:]])
    assert code == 1 and output.startswith(f"{out}: finished from rows changed since: 2 of 2 rows done")
    assert run_cli([*run, "--resume"])[0] == 0
    assert sorted(read_results(out).column("id").to_pylist()) == ["a", "c"]  # b's error row left out
    assert run_cli(["status", *run[1:]]) == (0, f"{out}: complete: 2 of 2 rows done, 0 remaining, 0 errored\n")
    # Without digests: --resume cannot check the rows of a changed dataset, and refuses it unless --resume-force.
    table = pa.ipc.open_file(str(out)).read_all()
    metadata = {k: v for k, v in (table.schema.metadata or {}).items() if k != b"batchgen.input_digests"}
    with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_file(sink, table.schema.with_metadata(metadata)) as writer:
        writer.write_table(table.replace_schema_metadata(metadata))
    write_jsonl(dataset, [rows[0], {"id": "c", "prompt_token_ids": [0, 8]}])  # c changed
    code, output = run_cli(["status", *run[1:]])
    assert code == 1 and f"{out} records no digests of its input rows, so they cannot be checked: --resume " in output
    assert run_cli([*run, "--resume"])[0] == 2
    assert run_cli(["status", *run[1:], "--resume-force"])[0] == 0
    assert run_cli([*run, "--resume-force"])[0] == 0


def test_status_of_a_jsonl_output_made_with_id_column_says_to_give_it(model: Path, tmp_path: Path) -> None:
    """JSON Lines records no options, so status without the run's --id-column reads ids the run did not use (found
    by a helper: every row looked foreign, with no word why); the note says what to give, also where an unreadable
    line's error row (null) matches the dataset's unreadable line (found by a helper), and with it all match."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"qid": i, "prompt_token_ids": [0, 5]} for i in ("a", "b")])
    dataset.write_text(dataset.read_text() + "garbage\n")
    out = tmp_path / "out.jsonl"
    assert run_cli(args(dataset, out, model, "--id-column", "qid", "--on-error", "skip"))[0] == 0
    hint = "(a run that took its ids from a column: give status its --id-column too)"
    assert f"{out}: note: 2 rows of {out} have an id {dataset} lacks {hint}" in status(dataset, out).splitlines()
    code, output = run_cli(["status", str(dataset), str(out), "--id-column", "qid"])
    assert code == 0 and output.startswith(f"{out}: complete: 3 of 3 rows done, 0 remaining, 1 errored"), output
    assert hint not in output


def test_a_finished_output_lacking_an_id_is_not_complete_whatever_its_row_count(model: Path, tmp_path: Path) -> None:
    """Remaining rows are counted by id (found by a new user: with row b replaced by c, a finished JSONL output of
    a and b counted 2 of 2 rows done, and --resume said it was complete, c never generated)."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt_token_ids": [0, 5]} for i in ("a", "b")])
    out = tmp_path / "out.jsonl"
    assert run_cli(args(dataset, out, model))[0] == 0
    write_jsonl(dataset, [{"id": i, "prompt_token_ids": [0, 5]} for i in ("a", "c")])
    lines = status(dataset, out).splitlines()
    assert lines[0].startswith(f"{out}: finished with rows missing: 1 of 2 rows done, 1 remaining")
    assert f"{out}: note: 1 row of {out} has an id {dataset} lacks" in lines
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 2 and "cannot add the rows it lacks" in output, output


def test_a_file_that_no_run_wrote_is_not_taken_for_a_finished_output(model: Path, tmp_path: Path) -> None:
    """Found by a new user: --resume with --out naming a copy of the input, or a JSONL of ids only, said "already
    complete; nothing to do" (exit 0), and status "complete: 0 of 2 rows done, 0 remaining"."""
    rows = [{"id": i, "prompt_token_ids": [0, 5], "max_new_tokens": 2} for i in ("a", "b")]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    for name, lines in [("copy.jsonl", rows), ("ids.jsonl", [{"id": "a"}, {"id": "b"}])]:
        out = write_jsonl(tmp_path / name, lines)
        # A run's partial output beside it is kept (it is no crash's leftover beside a finished output).
        partial_dir(out).mkdir()
        (partial_dir(out) / "part-00000.arrow").write_bytes(b"a run's rows")
        code, output = run_cli(args(dataset, out, model, "--resume"))
        assert (code, output) == (
            2,
            f"batchgen: error: {out}:1: not a batchgen output (it has no 'sample_index' or 'finish_reason'): is --out "
            "the file a run of this dataset wrote?\n",
        )
        assert out.read_text().count("\n") == 2  # left as it was
        assert (partial_dir(out) / "part-00000.arrow").read_bytes() == b"a run's rows"
    # Every line is read before anything beside OUT is removed, not the first alone.
    out = write_jsonl(tmp_path / "mixed.jsonl", [{"id": "a", "sample_index": 0, "finish_reason": "length"}, rows[1]])
    partial_dir(out).mkdir()
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 2 and f"{out}:2: not a batchgen output" in output and partial_dir(out).is_dir()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, output = run_cli(["status", str(dataset), str(empty)])
    assert (code, output) == (2, f"batchgen: error: {empty}: not a batchgen output (it has no rows): is --out the file "
                              "a run of this dataset wrote?\n")  # fmt: skip
    out = tmp_path / "other.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["x", "y"]}), out)
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 2 and f"{out}: not a batchgen output (it has no 'sample_index' or 'finish_reason')" in output
    code, output = run_cli(["status", str(dataset), str(out)])
    assert code == 2 and "not a batchgen output" in output


def test_overwrite_and_a_finished_job(
    small_job: tuple[Path, dict[Key, dict[str, Any]]], model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dataset, reference = small_job
    out = tmp_path / "out.jsonl"
    assert run_cli(args(dataset, out, model))[0] == 0
    before = out.read_bytes()
    # Finished: --resume does nothing (the model is not even loaded) and says so, and that a JSON Lines output
    # records nothing to check it by.
    start = time.monotonic()
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 0 and output.endswith(f"it is left as it is\nbatchgen: {out} is already complete; nothing to do\n")
    assert output.startswith(f"batchgen: warning: {out} is JSON Lines, which records nothing of the run that wrote it")
    assert time.monotonic() - start < 5 and out.read_bytes() == before
    code, output = run_cli(args(dataset, out, model))
    exists = "output file exists; pass --resume to finish or keep it, or --overwrite to replace it"
    assert code == 2 and output == f"batchgen: error: {out}: {exists}\n"
    code, output = run_cli(args(dataset, out, model, "--overwrite", "--resume"))
    assert code == 2 and "--overwrite and --resume exclude each other" in output
    # A crash between putting OUT in place and removing OUT.partial/ leaves both: OUT is the complete one.
    partial_dir(out).mkdir()
    (partial_dir(out) / "manifest.json").write_text("{}")
    code, output = run_cli(args(dataset, out, model, "--resume"))
    assert code == 0 and "already complete" in output and not partial_dir(out).exists()
    # --overwrite on an interrupted run starts over; a partial output is never silently reused or replaced.
    out.unlink()
    with monkeypatch.context() as patch:
        fail_part_write(patch, at=2)
        assert run_cli(args(dataset, out, model))[0] == 2
    code, output = run_cli(args(dataset, out, model))
    assert code == 2 and "an interrupted run's partial output is there; pass --resume to continue it" in output
    # One run at a time: the partial output is locked while a run writes it, and a run without --resume is not told
    # to resume an "interrupted" run then (found by a helper).
    with (partial_dir(out) / "lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for extra in (["--resume"], []):
            code, output = run_cli(args(dataset, out, model, *extra))
            assert code == 2 and output.endswith(f"{partial_dir(out)}: {WRITING}\n")
        # A run that took the lock just after this one's check of it (two scheduled runs starting together): this
        # one still stops before it loads the model (minutes for a large one). A model that is not there shows the
        # order.
        with monkeypatch.context() as patch:
            patch.setattr("batchgen.job.resume.held_by_a_run", lambda _: False)
            code, output = run_cli(args(dataset, out, tmp_path / "no-model", "--resume"))
        assert code == 2 and output.endswith(f"{partial_dir(out)}: {WRITING}\n")
    code, output = run_cli(args(dataset, out, tmp_path / "no-model", "--resume"))
    assert code == 2 and "no-model" in output and WRITING not in output
    code, output = run_cli(args(dataset, out, model, "--resume", "--flush-every", "0"))
    assert (code, output) == (2, "batchgen: error: --flush-every must be >= 1, got 0\n")
    code, output = run_cli(args(dataset, out, model, "--overwrite"))
    assert code == 0, output
    assert not partial_dir(out).exists()
    assert_same_rows(by_key(read_results(out).to_pylist()), reference)
    # --overwrite removes OUT only under the lock: a run that holds it may be putting OUT in place.
    before = out.read_bytes()
    partial_dir(out).mkdir()
    with (partial_dir(out) / "lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        code, output = run_cli(args(dataset, out, model, "--overwrite"))
    assert code == 2 and output.endswith(f"{partial_dir(out)}: {WRITING}\n")
    assert out.read_bytes() == before


# --- the pieces -------------------------------------------------------------------------------------------


def test_dataset_fingerprint_names_what_changed(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"x" * (3 << 20))
    before = fingerprint_dataset(path)
    assert before.differences(fingerprint_dataset(path)) == []
    assert DatasetFingerprint.from_json(before.to_json()) == before
    path.write_bytes(b"x" * (3 << 20) + b"\n")
    assert before.differences(fingerprint_dataset(path)) == [f"dataset size {3 << 20} → {(3 << 20) + 1} bytes"]
    path.write_bytes(b"x" * ((3 << 20) - 1) + b"y")  # the last byte: in the hashed last MiB
    assert before.differences(fingerprint_dataset(path)) == ["dataset content (its first or last MiB)"]
    path.write_bytes(b"x" * (3 << 20))
    assert before.differences(fingerprint_dataset(path))[0].startswith("dataset modification time")
    with pytest.raises(ValueError, match="not a dataset fingerprint"):
        DatasetFingerprint.from_json("{}")


def test_manifest_round_trip_and_checksum() -> None:
    schema = pa.schema([("id", pa.string())], metadata={"batchgen.model": "m"})
    data = encode_manifest(schema)
    assert decode_manifest(data).equals(schema, check_metadata=True)
    assert json.loads(data)["metadata"] == {"batchgen.model": "m"}  # readable by a person too
    tampered = data.replace(b'"batchgen.model": "m"', b'"batchgen.model": "n"')
    for bad in (tampered, data[:-5], b"", b"[]"):
        with pytest.raises(ValueError, match="not a manifest|checksum"):
            decode_manifest(bad)


def test_status_of_a_jsonl_output_lacking_rows_names_overwrite(model: Path, tmp_path: Path) -> None:
    """A new user's trial: status told a .jsonl output lacking a bad row to --resume, which refuses JSON Lines."""
    rows: list[dict[str, Any]] = [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i]} for i in range(3)]
    rows[1]["temperature"] = "x"
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    code, _ = run_cli(["run", str(dataset), "--out", str(out), "--model", str(model), *COMMON, "--max-new-tokens", "2"])
    assert code == 3
    assert read_output_status(dataset, out).lines()[0] == (
        f"{out}: finished with rows missing: 2 of 3 rows done, 1 remaining, 0 errored (bad rows that --on-error fail "
        "left out, or rows added since; a .jsonl output cannot be resumed: once they are fixed, --overwrite runs the "
        "dataset again)"
    )


@pytest.mark.parametrize("suffix", [".arrow", ".parquet"])
def test_resume_adds_the_rows_a_finished_output_lacks(suffix: str, model: Path, tmp_path: Path) -> None:
    """--on-error fail leaves a bad row out of a finished output; after the row is fixed, --resume generates exactly
    that row and keeps the others as they were (found by a new user: only --overwrite, which runs every row again,
    helped)."""
    rows: list[dict[str, Any]] = [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i]} for i in range(4)]
    rows[2]["temperature"] = "x"
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / f"out{suffix}"
    run = ["run", str(dataset), "--out", str(out), "--model", str(model), *COMMON, "--max-new-tokens", "3"]
    code, output = run_cli([*run, "--ignore-eos"])
    assert code == 3 and "batchgen: error: 1 bad input row left out" in output, output
    before = {row["id"]: row for row in read_results(out).to_pylist()}
    assert sorted(before) == ["r0", "r1", "r3"]
    assert read_output_status(dataset, out).lines()[0] == (
        f"{out}: finished with rows missing: 3 of 4 rows done, 1 remaining, 0 errored (bad rows that --on-error fail "
        "left out, or rows added since; --resume adds them to an .arrow or .parquet output once they are fixed)"
    )
    rows[2]["temperature"] = 0
    write_jsonl(dataset, rows)
    code, output = run_cli([*run, "--ignore-eos", "--resume"])
    assert code == 0, output
    lines = output.splitlines()
    assert lines[0] == f"batchgen: resuming {out}: 3 rows were done before"
    # One new generation: the fixed row's 2 prompt and 3 output tokens.
    assert lines[1].startswith("batchgen: 1 row done, 0 bad rows, 2 prompt + 3 output tokens in "), output
    after = {row["id"]: row for row in read_results(out).to_pylist()}
    assert sorted(after) == ["r0", "r1", "r2", "r3"] and len(read_results(out)) == 4
    assert {rid: after[rid] for rid in before} == before
    assert after["r2"]["completion_tokens"] == 3 and after["r2"]["finish_reason"] == "length"
    # Greedy: the same tokens as a run of the fixed row alone.
    alone = tmp_path / "alone.arrow"
    alone_dataset = write_jsonl(tmp_path / "alone.jsonl", [rows[2]])
    code, output = run_cli(["run", str(alone_dataset), "--out", str(alone), *run[4:], "--ignore-eos"])
    assert code == 0, output
    assert read_results(alone).to_pylist()[0]["output_token_ids"] == after["r2"]["output_token_ids"]
    assert read_output_status(dataset, out).lines()[0].startswith(f"{out}: complete: 4 of 4 rows done, 0 remaining")


@pytest.mark.parametrize("suffix", [".arrow", ".parquet"])
def test_a_row_fixed_by_renaming_its_field_is_added_by_resume(suffix: str, model: Path, tmp_path: Path) -> None:
    """The first-hour fix the error message suggests: a row with ``text`` instead of ``prompt`` is left out, the user
    renames the field, and ``--resume`` adds that row. The first run passed ``text`` through (as ``input_text``, null
    in the good rows); the fixed dataset has no such field, and the rows written now hold null there too."""
    rows: list[dict[str, Any]] = [{"id": f"r{i}", "prompt": f"Once upon a time {i}"} for i in range(3)]
    rows.insert(1, {"id": "b", "text": "The quick brown fox"})
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / f"out{suffix}"
    run = ["run", str(dataset), "--out", str(out), "--model", str(model), *COMMON, "--max-new-tokens", "3"]
    code, output = run_cli([*run, "--ignore-eos"])
    assert code == 3 and "(found 'text'; rename it to 'prompt' or pass --prompt-column text)" in output, output
    before = {row["id"]: row for row in read_results(out).to_pylist()}
    assert sorted(before) == ["r0", "r1", "r2"] and all(row["input_text"] is None for row in before.values())
    rows[1] = {"id": "b", "prompt": "The quick brown fox"}
    write_jsonl(dataset, rows)
    code, output = run_cli([*run, "--ignore-eos", "--resume"])
    assert code == 0, output
    after = {row["id"]: row for row in read_results(out).to_pylist()}
    assert sorted(after) == ["b", "r0", "r1", "r2"]
    assert {rid: after[rid] for rid in before} == before
    assert after["b"]["input_text"] is None and after["b"]["completion_tokens"] == 3


def test_a_run_of_more_rows_than_digests_may_cover_records_none(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digests grow with the rows; past MAX_DIGESTED_ROWS an output records none (a Parquet footer of 8M rows'
    digests no longer parsed), and is checked by the dataset's fingerprint alone, as an older batchgen's."""
    import batchgen.io.input_digests as input_digests
    from batchgen.io.input_digests import INPUT_DIGESTS_KEY

    monkeypatch.setattr(input_digests, "MAX_DIGESTED_ROWS", 3)
    for count, recorded in ((3, True), (4, False)):
        rows = [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i]} for i in range(count)]
        dataset = write_jsonl(tmp_path / f"in{count}.jsonl", rows)
        out = tmp_path / f"out{count}.parquet"
        code, output = run_cli(["run", str(dataset), "--out", str(out), "--model", str(model), *COMMON])
        assert code == 0, output
        metadata = pq.read_schema(out).metadata
        assert (INPUT_DIGESTS_KEY.encode() in metadata) == recorded, count


def test_resume_of_a_finished_output_names_the_rows_whose_input_changed(model: Path, tmp_path: Path) -> None:
    """--resume adds rows to a finished output only when the rows it holds still match the dataset; rows whose input
    changed are named and refused (generating them again would discard their results); --resume-force keeps them."""
    rows: list[dict[str, Any]] = [{"id": f"r{i}", "prompt_token_ids": [0, 5 + i]} for i in range(5)]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows[:4])
    out = tmp_path / "out.arrow"
    run = ["run", str(dataset), "--out", str(out), "--model", str(model), *COMMON, "--max-new-tokens", "2"]
    assert run_cli(run)[0] == 0
    before = out.read_bytes()
    kept = {row["id"]: row for row in read_results(out).to_pylist()}
    rows[0]["prompt_token_ids"] = [0, 9, 9]
    rows[3]["max_new_tokens"] = 1
    write_jsonl(dataset, rows[:1] + rows[2:])  # r1 left, r0 and r3 changed, r4 added
    code, output = run_cli([*run, "--resume"])
    assert code == 2, output
    assert output == (
        f"batchgen: error: cannot resume: the input of 3 rows of {out} changed in {dataset} or left it since it was "
        "made ('r0', 'r3', 'r1'); --resume does not generate them again, which would discard their results: pass "
        "--resume-force to keep them as they are and add any missing rows, or --overwrite to run the whole dataset "
        "again\n"
    )
    assert out.read_bytes() == before and not partial_dir(out).exists()
    code, output = run_cli([*run, "--resume-force"])
    assert code == 0, output
    assert output.startswith(
        f"batchgen: warning: the input of 3 rows of {out} changed in {dataset} or left it since it was made ('r0', "
        "'r3', 'r1'); --resume-force keeps their results\n"
    )
    after = {row["id"]: row for row in read_results(out).to_pylist()}
    assert sorted(after) == ["r0", "r1", "r2", "r3", "r4"]
    assert {rid: after[rid] for rid in kept} == kept
    assert not partial_dir(out).exists()


def test_resume_of_a_finished_output_with_all_rows_checks_the_dataset(model: Path, tmp_path: Path) -> None:
    """All rows there, but the dataset changed since: the changed row is named, and --resume-force keeps the output
    as it is; a dataset only rewritten (other spacing) is still the output's. An output that records no input digests
    (an older batchgen's) is checked by the dataset file's fingerprint alone."""
    rows = [{"id": "a", "prompt_token_ids": [0, 5]}, {"id": "b", "prompt_token_ids": [0, 6]}]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.arrow"
    flags = ["--max-new-tokens", "2", "--on-error", "fail"]
    run = ["run", str(dataset), "--out", str(out), "--model", str(model), *COMMON, *flags]
    code, output = run_cli(run)
    assert code == 0, output
    dataset.write_text("".join(json.dumps(row, indent=None, separators=(" ,", " : ")) + "\n" for row in rows))
    assert run_cli([*run, "--resume"]) == (0, f"batchgen: {out} is already complete; nothing to do\n")
    rows[0]["prompt_token_ids"] = [0, 7, 8]
    write_jsonl(dataset, rows)
    code, output = run_cli([*run, "--resume"])
    assert code == 2
    assert (
        f"cannot resume: the input of 1 row of {out} changed in {dataset} or left it since it was made ('a');" in output
    )
    code, output = run_cli([*run, "--resume-force"])
    assert code == 0 and "--resume-force keeps their results" in output and "already complete" in output
    # Without digests (the key removed from the file's metadata), as before they were recorded:
    table = read_results(out)
    metadata = {k: v for k, v in (table.schema.metadata or {}).items() if k != b"batchgen.input_digests"}
    with pa.ipc.new_file(out, table.schema.with_metadata(metadata)) as writer:
        writer.write_table(table)
    code, output = run_cli([*run, "--resume"])
    assert code == 2 and f"{out} is a finished output made from {dataset} before it changed (" in output
    assert "pass --resume-force to keep it as it is, or --overwrite" in output
    code, output = run_cli([*run, "--resume-force"])
    assert code == 0 and "--resume-force keeps it" in output and "already complete" in output


def test_resume_of_a_complete_output_checks_the_settings(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--resume on a complete output made with other settings (found by a new user: a nightly job's changed seed and
    temperature were "already complete; nothing to do") is refused, naming each difference, without loading the
    model; the same settings, spelled as they were or left to the recorded ones (--dtype auto, no --seed, a template's
    escapes from a config file), still do nothing; --resume-force keeps the output as it is."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt_token_ids": [0, 5]}])
    out = tmp_path / "out.parquet"
    run = ["run", str(dataset), "--out", str(out), "--model", str(model), "--device", "cpu", "--no-progress"]
    first = [*run, "--dtype", "float32", "--seed", "7", "--temperature", "0.5", "--max-new-tokens", "2"]
    assert run_cli(first)[0] == 0
    before = out.read_bytes()
    complete = f"batchgen: {out} is already complete; nothing to do\n"
    assert run_cli([*first, "--resume"]) == (0, complete)
    same = [*run, "--dtype", "auto", "--temperature", "0.5", "--max-new-tokens", "2", "--resume"]
    assert run_cli(same) == (0, complete)
    with monkeypatch.context() as patch:
        patch.setenv("BATCHGEN_CPU_PREPACK", "0")
        code, output = run_cli([*first, "--resume"])
        assert code == 2 and "differs from the one that wrote it: BATCHGEN_CPU_PREPACK True → False; --resume" in output
    changed = [*run, "--dtype", "bfloat16", "--seed", "8", "--temperature", "0.7", "--max-new-tokens", "2"]
    start = time.monotonic()
    code, output = run_cli([*changed, "--resume"])
    assert time.monotonic() - start < 5  # the model was not loaded
    assert (code, output) == (
        2,
        f"batchgen: error: {out} is complete, but this run differs from the one that wrote it: dtype 'float32' → "
        "'bfloat16'; temperature 0.5 → 0.7; seed 7 → 8; --resume keeps a finished output as it is: pass --overwrite "
        "to run the dataset again with these settings, or --resume-force to keep it\n",
    )
    code, output = run_cli([*changed, "--resume-force"])
    assert code == 0 and output.startswith(f"batchgen: warning: {out} was written with other settings (dtype")
    assert output.endswith(f"--resume-force keeps it as it is\n{complete}") and out.read_bytes() == before
    templated = tmp_path / "t.parquet"
    template = ["--prompt-template", "Q: {q}\\nA:", "--max-new-tokens", "1"]
    write_jsonl(dataset, [{"id": "a", "q": "x"}])
    assert run_cli([*run[:3], str(templated), *run[4:], *template])[0] == 0
    config = tmp_path / "c.yaml"
    config.write_text('prompt-template: "Q: {q}\\nA:"\nmax-new-tokens: 1\n')  # YAML's escape: a newline
    code, output = run_cli([*run[:3], str(templated), *run[4:], "--config", str(config), "--resume"])
    assert (code, output) == (0, f"batchgen: {templated} is already complete; nothing to do\n")


@pytest.mark.parametrize("where", ["finished", "partial", "partial with the fixed row"])
def test_a_bad_row_fixed_since_is_generated_in_place_of_its_error_row(where: str, model: Path, tmp_path: Path) -> None:
    """--on-error skip wrote a bad row (and a duplicate id) as error rows; the bad row fixed in the dataset, --resume
    (a finished output) or --resume-force (a partial output, whose dataset fingerprint changed; or one whose resumed
    run had generated the fixed row when it stopped) generates it, and the output holds each id as an uninterrupted
    run of the fixed dataset gives it: no error row of the fixed row beside its samples (found by a new user: only
    --overwrite regenerated it, and a partial output gave both)."""
    rows = [
        {"id": "a", "prompt_token_ids": [0, 5]},
        {"id": "b", "prompt_token_ids": [0, 6], "temperature": -1},
        {"id": "c", "prompt_token_ids": [0, 7]},
        {"id": "a", "prompt_token_ids": [0, 9]},  # a duplicate id: an error row, in both runs
    ]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out, reference = tmp_path / "out.arrow", tmp_path / "reference.arrow"
    # Sampled: --ignore-eos, since the rows' finish reasons are written below as "length" (a seed's draws are
    # another CPU's own, where an early EOS would say "stop").
    flags = [*COMMON, "--max-new-tokens", "2", "--on-error", "skip", "--seed", "3", "--ignore-eos"]
    run = ["run", str(dataset), "--model", str(model), *flags, "--out"]
    assert run_cli([*run, str(out)])[0] == 0
    assert [(r["id"], r["finish_reason"]) for r in read_results(out).to_pylist()].count(("b", "error")) == 1
    del rows[1]["temperature"]
    write_jsonl(dataset, rows)
    assert run_cli([*run, str(reference)])[0] == 0
    want = read_results(reference).to_pylist()
    if where != "finished":  # the finished output's rows as the parts of a run stopped after them
        table = read_results(out)
        if where == "partial with the fixed row":
            fixed = [row for row in want if row["id"] == "b"]
            table = pa.concat_tables([table, pa.Table.from_pylist(fixed, table.schema)])
        with pa.ipc.new_file(out, table.schema) as writer:
            writer.write_table(table)
        partial = PartialOutput(out)
        reopen_output(partial, table.schema, None)
        partial.close()
    code, output = run_cli([*run, str(out), "--resume" if where == "finished" else "--resume-force"])
    generated = "0 rows done" if where == "partial with the fixed row" else "1 row done"
    assert code == 0 and f"{generated}, 0 bad rows" in output, output

    def key(row: dict[str, Any]) -> tuple[str, str]:
        return row["id"], row["finish_reason"]

    got = read_results(out).to_pylist()
    assert sorted(map(key, got)) == sorted(map(key, want)) == [("a", "error"), ("a", "length"), ("b", "length"),
                                                                ("c", "length")]  # fmt: skip
    assert sorted(got, key=key) == sorted(want, key=key)
    assert run_cli([*run, str(out), "--resume"])[1] == f"batchgen: {out} is already complete; nothing to do\n"


GOOD = {"prompt_token_ids": [0, 5]}


@pytest.mark.parametrize(
    ("before", "after"),
    [
        # b fixed, and a new duplicate of b: its error row is the duplicate's, with its own message
        ([{"id": "a", **GOOD}, {"id": "b", **GOOD, "temperature": -1}],
         [{"id": "a", **GOOD}, {"id": "b", **GOOD}, {"id": "c", **GOOD}, {"id": "b", **GOOD}]),
        # b still bad, otherwise: the new error row, not the old one
        ([{"id": "a", **GOOD}, {"id": "b", **GOOD, "temperature": -1}],
         [{"id": "a", **GOOD}, {"id": "b", **GOOD, "top_p": 7}]),
        # a duplicate removed: its error row goes
        ([{"id": "a", **GOOD}, {"id": "b", **GOOD}, {"id": "a", **GOOD}], [{"id": "a", **GOOD}, {"id": "b", **GOOD}]),
        # an unreadable line (its error row's id is its index) mended
        ([{"id": "a", **GOOD}, '{"id": "b", "prompt_token_ids": [0, 5]', {"id": "c", **GOOD}],
         [{"id": "a", **GOOD}, {"id": "b", **GOOD}, {"id": "c", **GOOD}]),
    ],
)  # fmt: skip
def test_resume_after_error_rows_changed_gives_the_run_of_the_dataset_as_it_is(
    before: list[Any], after: list[Any], model: Path, tmp_path: Path
) -> None:
    """Error rows stand only while their row fails with the same message: after the dataset changed, --resume of
    the finished output gives what an uninterrupted run of the dataset as it is gives (found by a reviewer: a fixed
    row kept another row's error message, a row failing otherwise kept its old error, a removed duplicate's error row
    stayed, and a mended unreadable line was refused as a changed row)."""
    dataset, out, reference = tmp_path / "in.jsonl", tmp_path / "out.arrow", tmp_path / "reference.arrow"
    flags = [*COMMON, "--max-new-tokens", "2", "--on-error", "skip", "--seed", "3"]
    run = ["run", str(dataset), "--model", str(model), *flags, "--out"]

    def write(rows: list[Any]) -> None:
        dataset.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))

    write(before)
    assert run_cli([*run, str(out)])[0] == 0
    write(after)
    code, output = run_cli([*run, str(out), "--resume"])
    assert code == 0, output
    code, reference_output = run_cli([*run, str(reference)])
    assert code == 0
    assert reference_output.count("(written as an error row)") == output.count("(written as an error row)")

    def key(row: dict[str, Any]) -> tuple[str, str, str]:
        return row["id"], row["finish_reason"], row["error"] or ""

    got, want = read_results(out).to_pylist(), read_results(reference).to_pylist()
    assert sorted(got, key=key) == sorted(want, key=key)


def test_resume_of_an_output_without_input_digests_needs_force_to_add_rows(model: Path, tmp_path: Path) -> None:
    """An output that records no input digests (an older batchgen's) cannot have its rows checked: --resume says so,
    and --resume-force keeps its rows and adds the missing one."""
    rows = [{"id": "a", "prompt_token_ids": [0, 5]}, {"id": "b", "prompt_token_ids": [0, 6], "temperature": "x"}]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.arrow"
    run = ["run", str(dataset), "--out", str(out), "--model", str(model), *COMMON, "--max-new-tokens", "2"]
    assert run_cli(run)[0] == 3
    table = read_results(out)
    metadata = {k: v for k, v in (table.schema.metadata or {}).items() if k != b"batchgen.input_digests"}
    with pa.ipc.new_file(out, table.schema.with_metadata(metadata)) as writer:
        writer.write_table(table)
    rows[1]["temperature"] = 0
    write_jsonl(dataset, rows)
    code, output = run_cli([*run, "--resume"])
    assert (code, output) == (
        2,
        f"batchgen: error: {out} holds 1 of the 2 rows of {dataset} and records no digests of its input rows (an "
        "older batchgen made it), so they cannot be checked: pass --resume-force to keep them and add the missing "
        "rows, or --overwrite to run the whole dataset again\n",
    )
    code, output = run_cli([*run, "--resume-force"])
    assert code == 0, output
    after = {row["id"]: row for row in read_results(out).to_pylist()}
    assert sorted(after) == ["a", "b"] and after["a"] == table.to_pylist()[0]


def test_resume_of_a_finished_jsonl_output_that_lacks_rows_says_why_not(model: Path, tmp_path: Path) -> None:
    """JSON Lines holds no metadata: no model, seed or input digests to check a resumed run against."""
    rows = [{"id": "a", "prompt_token_ids": [0, 5]}, {"id": "b", "prompt_token_ids": [0, 6], "temperature": "x"}]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    run = ["run", str(dataset), "--out", str(out), "--model", str(model), *COMMON, "--max-new-tokens", "2"]
    assert run_cli(run)[0] == 3
    before = out.read_bytes()
    rows[1]["temperature"] = 0
    write_jsonl(dataset, rows)
    for resume in ("--resume", "--resume-force"):
        code, output = run_cli([*run, resume])
        assert (code, output) == (
            2,
            f"batchgen: error: {out}: a finished JSON Lines output records nothing of the run that made it (model, "
            "seed, inputs), so --resume cannot add the rows it lacks; pass --overwrite to run the whole dataset "
            "again (.arrow and .parquet outputs can be resumed)\n",
        )
        assert out.read_bytes() == before


def test_status_of_a_jsonl_output_says_it_cannot_check_the_dataset(tmp_path: Path) -> None:
    """A finished JSONL output holds no run metadata, so status cannot tell which dataset made it: it says so
    instead of reporting "complete" for another file's output without comment (found by a new user)."""
    dataset = tmp_path / "in.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(3)))
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "0", "sample_index": 0, "finish_reason": "length"}) + "\n")
    lines = read_output_status(dataset, out).lines()
    assert lines[0].startswith(f"{out}: finished with rows missing: 1 of 3 rows done, 2 remaining, 0 errored")
    note = "records no dataset fingerprint (JSONL has no metadata): it may come from another file"
    assert lines[1] == f"{out}: note: {out} {note}"
