"""The lock of a partial output (``OUT.partial/lock``): one run at a time writes an output, and status can tell
whether a run is writing it."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from batchgen.errors import BatchgenError

LOCK = "lock"
# Why a run cannot have the output now, and what to do (a run holding the lock ends, however it ends, with its lock).
WRITING = "another batchgen run is writing this output; wait for it to end"


def take_lock(directory: Path) -> int:
    """Take the lock of the partial output ``directory`` (which must exist); return its file descriptor, which holds
    it until closed. The kernel releases it when the process ends, however it ends: a kill -9 leaves no stale lock.

    Raises:
        BatchgenError: another run holds it, or the lock file cannot be opened.
    """
    try:
        fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise BatchgenError(f"{directory}: cannot lock the partial output: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise BatchgenError(f"{directory}: {WRITING}") from None
    return fd


def held_by_a_run(directory: Path) -> bool | None:
    """Whether a run on this machine holds the lock of the partial output ``directory`` now (the kernel drops it when
    that run ends, however it ends), as Linux lists it in ``/proc/locks`` (``FLOCK ADVISORY WRITE pid
    major:minor:inode``): read, not tried, since a probe's own lock, however short, can make a run starting at that
    instant fail (found by a helper). ``False`` where no run ever took it (no lock file); ``None`` where this machine
    cannot say (no such listing: not Linux). A run on another machine over a shared filesystem is not listed here."""
    try:
        found = os.stat(directory / LOCK)
    except OSError:
        return False
    try:
        held = Path("/proc/locks").read_text().split("\n")
    except OSError:
        return None
    inode = f"{os.major(found.st_dev):02x}:{os.minor(found.st_dev):02x}:{found.st_ino}"
    return any(fields[1:3] == ["FLOCK", "ADVISORY"] and inode in fields for fields in map(str.split, held))
