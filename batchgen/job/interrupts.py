"""Stop a run cleanly on SIGINT, SIGTERM or SIGHUP: the first signal asks the loop to stop after the current
round (finished rows are flushed to the partial output, which a rerun with ``--resume`` continues); a second one
ends the process at once. That is safe at any instant, as a ``kill -9`` is: the partial output only ever holds
complete part files, and a half-written one is dropped on resume."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopRequest:
    """Set by the signal handler; the loop checks :attr:`signum` between rounds."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is not None:
            # A second signal: the user does not want to wait for the flush. Nothing needs to run on the way out.
            name = signal.Signals(signum).name
            os.write(2, f"batchgen: second {name}: stopped at once; rerun with --resume to continue\n".encode())
            os._exit(128 + signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


@contextmanager
def graceful_stop() -> Iterator[StopRequest]:
    """Install the handlers for the duration of a run (main thread only; not for a signal the process ignores) and
    restore the previous ones, unless a signal asked the run to stop: the process is then on its way out, and a
    second signal during the rest of that way (summary, resume hint, interpreter shutdown) must still end it at
    once, without a traceback."""
    request = StopRequest()
    previous = {}
    try:
        for sig in HANDLED_SIGNALS:
            # A signal the caller ignores stays ignored: nohup's SIGHUP, a shell's background job's SIGINT.
            if signal.getsignal(sig) is not signal.SIG_IGN:
                previous[sig] = signal.signal(sig, request.handle)
    except ValueError:  # not the main thread (e.g. an embedding application): leave signals alone
        pass
    try:
        yield request
    finally:
        if request.signum is None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
