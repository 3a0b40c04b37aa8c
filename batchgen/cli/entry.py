"""The console entry point (``batchgen`` and ``python -m batchgen``).

Before anything imports torch it keeps PyTorch's OpenMP threads spinning between ops
(:func:`batchgen.environment.keep_openmp_threads_spinning`).

Importing the CLI imports torch and transformers, which takes seconds, and Typer then reads the command line; a
Ctrl-C in that time would otherwise end in a KeyboardInterrupt traceback from deep inside an import, or in no word
at all. Here it ends the process with one line, as a stop does (128 + SIGINT); once a command starts, its own
handling takes over (:func:`batchgen.cli.release_startup_interrupts`, :mod:`batchgen.job.interrupts`).
"""

from __future__ import annotations

import sys

from batchgen.cli import hold_startup_interrupts, version_line


def main() -> None:
    """Import the CLI and run it; ``batchgen --version`` alone is answered without it (no torch import)."""
    if sys.argv[1:] == ["--version"]:
        print(version_line())
        return
    hold_startup_interrupts()  # before any other import (found by a helper: a Ctrl-C inside json's gave a traceback)
    from batchgen.environment import keep_openmp_threads_spinning

    keep_openmp_threads_spinning()  # before the CLI imports torch
    from batchgen.cli.app import main as run_cli

    run_cli()
