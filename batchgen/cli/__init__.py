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


_starting = True  # until a command starts (release_startup_interrupts)
_console = False  # the process is the console command's (hold_startup_interrupts), not a host's that runs the app


def _stopped_while_starting(signum: int, frame: FrameType | None) -> None:
    what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    print(f"batchgen: {what}{' while starting' if _starting else ''}", file=sys.stderr, flush=True)
    # Not SystemExit: torch's C++ imports swallow an exception raised inside them and start-up would go on. Nothing
    # needs closing yet: no row has run.
    os._exit(128 + signum)


def hold_startup_interrupts() -> None:
    """Until a command takes them over, a Ctrl-C, SIGTERM or SIGHUP ends the process with one line on stderr and
    exit code 128 + the signal. Importing the CLI takes seconds, and Typer turns a KeyboardInterrupt raised while it
    reads the command line (its parameter types import pydantic) into a silent exit 130; a scheduler's SIGTERM ended
    it with no word at all. Only where the default handlers are in place: a signal the caller ignores (a shell's
    background job ignores SIGINT, nohup SIGHUP) stays ignored."""
    global _console
    _console = True
    defaults = {
        signal.SIGINT: signal.default_int_handler,
        signal.SIGTERM: signal.SIG_DFL,
        signal.SIGHUP: signal.SIG_DFL,
    }
    for sig, default in defaults.items():
        if signal.getsignal(sig) is default:
            signal.signal(sig, _stopped_while_starting)


def release_startup_interrupts(still_starting: bool = False) -> None:
    """From here a Ctrl-C raises KeyboardInterrupt again, for the command's own handling: called as a command
    starts. SIGTERM and SIGHUP still end it with one line until a run installs its own handlers, saying "while
    starting" where ``still_starting`` (the command's start-up goes on: a run's model load)."""
    global _starting
    _starting = still_starting
    if signal.getsignal(signal.SIGINT) is _stopped_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_finishing_signal: list[int] = []  # the stop signals that came after the run had finished


def _after_the_run(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    if _finishing_signal:
        os._exit(128 + signum)  # a second one: the caller insists, and nothing is left to lose
    _finishing_signal.append(signum)
    os.write(2, f"batchgen: {name} came after the run had finished: its output is written; ending as done\n".encode())


def hold_finished_interrupts() -> None:
    """Once ``run`` has finished its output, a stop signal has nothing left to stop: one line says so and the command
    ends as it would have (its summary, exit status 0 or 3); a second one ends it at once with 128 + the signal.
    Found by a helper: a SIGTERM after the summary said "stopped while starting", exit 143, over a complete output,
    and a Ctrl-C there ended it with 130 and no word. A signal the caller ignores stays ignored. Only in the console
    command's process: a host that runs the app in its own (a test's runner) keeps its handlers."""
    if not _console:
        return
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _after_the_run)
