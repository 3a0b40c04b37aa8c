"""Durable file-system steps: a file's bytes and a directory's entries reach the disk before we rely on them.

A rename is atomic (the name points at the old file or the new one, never at a mix), but neither the renamed
file's data nor the rename itself survives a power cut unless the file and then its directory are fsynced.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (files created, renamed or removed in it) durable.

    Raises:
        OSError: the directory cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Make the data of the closed file ``path`` durable.

    Raises:
        OSError: the file cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` by a file holding ``data``: after a crash at any instant it holds the old or the new bytes.

    The bytes go to ``<path>.tmp`` first, which is fsynced and then renamed over ``path``.

    Raises:
        OSError: writing, syncing or renaming failed; ``path`` is then unchanged (a stray ``.tmp`` may remain).
    """
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
