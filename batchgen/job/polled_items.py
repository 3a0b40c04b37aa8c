"""Items read on a thread of their own, so that a loop waiting for them still acts on time: ``--ray``'s results,
which come a batch at a time, minutes apart, while the job must flush its finished rows and see a stop signal."""

from __future__ import annotations

import contextlib
import ctypes
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def poll_every(seconds: float, items: Iterable[T]) -> Iterator[T | None]:
    """``items``, read on a thread of their own, with ``None`` between them whenever ``seconds`` pass without one:
    the job flushes finished rows and sees a stop signal on time while a replica runs a long batch.

    Closing the iterator stops the reading at once: an iteration waiting for its next item gets an exception
    raised in it, as a Ctrl-C raises one in a main thread, so that its own cleanup runs (Ray Data's shuts its
    executor down) before the caller goes on, and before it shuts Ray down under a reading that still uses it.

    Raises:
        what reading ``items`` raised, where it was raised, after the items before it.
    """
    reader = _Reader(items, seconds)
    reader.start()
    try:
        while True:
            try:
                kind, value = reader.ready.get(timeout=seconds)
            except queue.Empty:
                yield None
                continue
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        reader.close()


_END = object()  # what the items' iterator gives at its end


class _Closed(BaseException):
    """Raised in a :class:`_Reader`'s thread while it waits for an item, when the reading side closes."""


class _Reader(threading.Thread):
    """Reads ``items`` into :attr:`ready` (a queue of one entry: ``("item", x)``, ``("end", None)`` or
    ``("error", exception)``) until the end or :meth:`close`."""

    def __init__(self, items: Iterable[Any], seconds: float) -> None:
        super().__init__(name="batchgen-ray-results", daemon=True)
        self.items, self.seconds = items, seconds
        self.ready: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=1)
        self.closed = threading.Event()
        # Held to flip _waiting and to raise _Closed: the exception then lands only inside run()'s try.
        self._guard = threading.Lock()
        self._waiting = False

    def run(self) -> None:
        try:
            iterator = iter(self.items)
            while True:
                self._wait(True)
                try:
                    item = next(iterator, _END)
                finally:
                    self._wait(False)  # before the end is handed: a close after it finds nothing to interrupt
                if item is _END:
                    self._hand("end", None)
                    return
                if not self._hand("item", item):
                    return
        except BaseException as e:  # handed to the reading side, which raises it there
            self._hand("error", e)

    def close(self, wait: float = 30.0) -> None:
        """Stop the reading and wait up to ``wait`` seconds for the items' cleanup (Ray Data's joins its executor
        for up to 2 s and cancels the batches in flight)."""
        with self._guard:
            self.closed.set()
            if self._waiting and self.ident is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident), ctypes.py_object(_Closed))
        self.join(wait)

    def _wait(self, waiting: bool) -> None:
        with self._guard:
            if waiting and self.closed.is_set():
                raise _Closed  # closed before this wait began: none to interrupt
            self._waiting = waiting

    def _hand(self, kind: str, value: Any) -> bool:
        """Queue one entry unless the reading side closed first; whether it did not."""
        while not self.closed.is_set():
            with contextlib.suppress(queue.Full):
                self.ready.put((kind, value), timeout=self.seconds)
                return True
        return False
