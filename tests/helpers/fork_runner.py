"""Test helper: start many ``batchgen`` runs as separate processes without paying ~4 s of imports for each.

A *zygote* process imports batchgen (torch, transformers) once, runs no model, and forks one child per run; each
child is an ordinary process running ``batchgen.cli.main`` with its own argv, environment and log file, and can
be killed like any other, or made to die at an exact point of its work (crash_points.py). The test talks to the
zygote over its stdin/stdout, one JSON object per line: ``{"argv": [...], "env": {...}, "log": PATH, "crash":
[KIND, N] or null}`` → ``{"pid": N}``, and ``{"wait": N}`` → ``{"code": C}`` (the exit code, or minus the signal
that killed it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

from tests.helpers import crash_points


def _pythonpath() -> str:
    """The repository first, so that the zygote imports ``tests.helpers`` (and this checkout's ``batchgen``)."""
    repo = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)


class Zygote:
    """The test's end: start the zygote, fork runs from it, wait for them."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        """``env``: added to this process's environment for the zygote and every run (e.g. OMP_NUM_THREADS,
        which torch reads when it is imported)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.fork_runner"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath(), **(env or {})},
        )

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        assert reply, f"the zygote died (exit code {self.proc.poll()})"
        return dict(json.loads(reply))

    def start(
        self, argv: list[str], env: dict[str, str], log: Path, crash: crash_points.CrashPoint | None = None
    ) -> int:
        """Fork a ``batchgen`` run; its stdout and stderr go to ``log``; with ``crash``, it dies at that point
        (see crash_points.py). Returns its pid."""
        return int(self._ask({"argv": argv, "env": env, "log": str(log), "crash": crash})["pid"])

    def wait(self, pid: int) -> int:
        """Wait for run ``pid`` to end; its exit code, or minus the signal that killed it."""
        return int(self._ask({"wait": pid})["code"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become ``batchgen ARGV`` and exit with its exit code; never returns."""
    code = 1
    try:
        os.environ.update(request["env"])
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        sys.argv = ["batchgen", *request["argv"]]
        if request["crash"] is not None:
            kind, count = request["crash"]
            crash_points.install((kind, count))
        from batchgen.cli.app import main

        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve() -> None:
    # The imports each child would otherwise pay for (transformers' modeling code pulls in torch._dynamo, sympy,
    # accelerate: most of the time a run takes to start). Imports only: no model runs here, no thread pool starts.
    import transformers.modeling_utils  # noqa: F401

    import batchgen.cli.app  # noqa: F401
    import batchgen.job.run_job  # noqa: F401

    running: set[int] = set()
    for line in sys.stdin:
        request = json.loads(line)
        if "argv" in request:
            pid = os.fork()
            if pid == 0:
                _child(request)
            running.add(pid)
            reply: dict[str, Any] = {"pid": pid}
        else:
            _, status = os.waitpid(request["wait"], 0)
            running.discard(request["wait"])
            reply = {"code": os.waitstatus_to_exitcode(status)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    # The test is over (perhaps failed half-way): no run outlives it.
    for pid in running:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    _serve()
