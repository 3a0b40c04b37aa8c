"""The ``batchgen`` command line: the Typer app (``app``), one module per command group, and the console entry.

Importing this package imports nothing heavy; ``batchgen.cli.app`` pulls in torch and transformers.
"""

import os
import signal
import sys
from types import FrameType

from batchgen import __version__


def version_line() -> str:
    """What ``batchgen --version`` prints."""
    return f"batchgen {__version__}"


def _interrupted_while_starting(signum: int, frame: FrameType | None) -> None:
    print("batchgen: interrupted while starting", file=sys.stderr, flush=True)
    # Not SystemExit: torch's C++ imports swallow an exception raised inside them and start-up would go on. Nothing
    # needs closing yet: no command has started.
    os._exit(128 + signal.SIGINT)


def hold_startup_interrupts() -> None:
    """Until :func:`release_startup_interrupts`, a Ctrl-C ends the process with one line on stderr and exit code
    130. Importing the CLI takes seconds, and Typer turns a KeyboardInterrupt raised while it reads the command
    line (its parameter types import pydantic) into a silent exit 130. Only where Python's own handler is in place:
    a shell's background job, which ignores SIGINT, keeps ignoring it."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_while_starting)


def release_startup_interrupts() -> None:
    """From here a Ctrl-C raises KeyboardInterrupt again, for the command's own handling: called as a command
    starts."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)
