"""``poll_every``: ``--ray``'s results, read on a thread, with a ``None`` whenever a wait is long (so the job flushes
and sees a stop signal on time)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from batchgen.job.polled_items import poll_every


def _slow(values: list[int], pause: float) -> Iterator[int]:
    for value in values:
        time.sleep(pause)
        yield value


def test_items_in_order_with_none_while_waiting() -> None:
    got = list(poll_every(0.02, _slow([1, 2, 3], 0.15)))
    assert [x for x in got if x is not None] == [1, 2, 3]
    assert got.count(None) >= 3  # 0.15 s between items, a None every 0.02 s: several per wait


def test_no_none_when_items_come_quickly() -> None:
    assert list(poll_every(5.0, iter(range(5)))) == [0, 1, 2, 3, 4]


def test_an_error_of_the_items_is_raised_to_the_reader() -> None:
    def failing() -> Iterator[int]:
        yield 1
        raise ValueError("replica failed")

    it = poll_every(1.0, failing())
    assert next(it) == 1
    with pytest.raises(ValueError, match="replica failed"):
        list(it)


def test_closing_early_stops_the_reading_thread() -> None:
    read: list[int] = []

    def counting() -> Iterator[int]:
        for i in range(1000):
            read.append(i)
            yield i

    it = poll_every(0.01, counting())
    assert next(it) == 0
    it.close()
    deadline = time.monotonic() + 2
    while any(t.name == "batchgen-ray-results" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "batchgen-ray-results" for t in threading.enumerate())
    assert len(read) < 10  # the queue holds one item: the thread stopped soon after, not at the end


def test_closing_while_the_items_wait_runs_their_cleanup_before_it_returns() -> None:
    """As Ray Data's iterator must shut its executor down before the job shuts Ray down: the wait for the next
    item (a replica's long batch) is interrupted, not waited out."""
    cleaned: list[str] = []

    def waiting_forever() -> Iterator[int]:
        yield 0
        try:
            while True:
                time.sleep(0.01)
        except BaseException as e:
            cleaned.append(type(e).__name__)
            raise

    it = poll_every(0.01, waiting_forever())
    assert next(it) == 0
    assert next(it) is None  # the reader now waits in the items
    start = time.monotonic()
    it.close()
    assert cleaned == ["_Closed"]
    assert time.monotonic() - start < 2
    assert not any(t.name == "batchgen-ray-results" for t in threading.enumerate())
