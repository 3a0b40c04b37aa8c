"""The console entry point (``batchgen`` and ``python -m batchgen``).

Before anything imports torch it keeps PyTorch's OpenMP threads spinning between ops
(:func:`batchgen.environment.keep_openmp_threads_spinning`).

Importing the CLI imports torch and transformers, which takes seconds; a Ctrl-C in that time would otherwise end
in a KeyboardInterrupt traceback from deep inside an import. Here it ends the process quietly, as a stop does
(128 + SIGINT). Once the command runs, its own handlers take over (:mod:`batchgen.job.interrupts`).
"""

from __future__ import annotations

import signal
import sys

from batchgen.cli import version_line
from batchgen.environment import keep_openmp_threads_spinning


def main() -> None:
    """Import the CLI and run it; ``batchgen --version`` alone is answered without it (no torch import)."""
    if sys.argv[1:] == ["--version"]:
        print(version_line())
        return
    keep_openmp_threads_spinning()  # before the CLI imports torch
    try:
        from batchgen.cli.app import main as run_cli
    except KeyboardInterrupt:
        print("batchgen: interrupted while starting", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None
    run_cli()
