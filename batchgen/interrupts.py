"""Stop a run cleanly on SIGINT, SIGTERM or SIGHUP: the first signal asks the loop to stop after the current
round (finished rows are written and the output file is closed, so it stays readable); a second one aborts."""

from __future__ import annotations

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
            raise KeyboardInterrupt  # a second signal: stop now (the writer is still closed on the way out)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


@contextmanager
def graceful_stop() -> Iterator[StopRequest]:
    """Install the handlers for the duration of a run (main thread only) and restore the previous ones."""
    request = StopRequest()
    previous = {}
    try:
        for sig in HANDLED_SIGNALS:
            previous[sig] = signal.signal(sig, request.handle)
    except ValueError:  # not the main thread (e.g. an embedding application): leave signals alone
        pass
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
