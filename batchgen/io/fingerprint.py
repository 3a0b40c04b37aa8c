"""A cheap fingerprint of the dataset (of each of its shards), so that a resumed run can tell whether its input changed.

The fingerprint is the file's size, its modification time and a SHA-256 of its first and last MiB (the whole file
when it is at most 2 MiB). It costs two 1 MiB reads whatever the dataset's size, where a hash of the whole file
would read every byte again at every resume (minutes for a multi-GB dataset). What it catches: appended, removed
or truncated rows (size, last MiB), edits at either end (the hashes), and any edit that rewrites the file
(modification time). What it may miss: a same-size edit in the middle written with the old modification time
restored. What may flag a change that is none: a copy or ``touch`` that changes only the modification time; an
output whose rows have input digests (:mod:`batchgen.io.input_digests`) is then checked row by row, and one without
needs ``--resume-force``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from batchgen.errors import BatchgenError
from batchgen.io.shards import list_shards

SAMPLE_BYTES = 1 << 20


@dataclass(frozen=True)
class DatasetFingerprint:
    """What identifies one version of a dataset file (see the module docstring); for a dataset of shards (a
    directory or a glob), each shard's fingerprint by its name (:meth:`batchgen.io.shards.Shards.name`), with their
    total size, latest modification time and a hash of their fingerprints."""

    size: int
    mtime_ns: int
    sample_sha256: str
    shards: dict[str, DatasetFingerprint] | None = None

    def to_json(self) -> str:
        data = asdict(self)
        if self.shards is None:  # a lone file's fingerprint reads as it did before datasets had shards
            del data["shards"]
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DatasetFingerprint:
        """Parse :meth:`to_json`'s output.

        Raises:
            ValueError: not a fingerprint.
        """
        try:
            return cls._from_data(json.loads(text))
        except (TypeError, KeyError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a dataset fingerprint: {e}") from None

    @classmethod
    def _from_data(cls, data: dict[str, Any]) -> DatasetFingerprint:
        shards = data.get("shards")
        return cls(
            size=int(data["size"]),
            mtime_ns=int(data["mtime_ns"]),
            sample_sha256=str(data["sample_sha256"]),
            shards=None if shards is None else {str(k): cls._from_data(v) for k, v in shards.items()},
        )

    def differences(self, now: DatasetFingerprint) -> list[str]:
        """How the dataset changed from ``self`` (recorded) to ``now``, in words; empty when it did not."""
        if self.shards is None or now.shards is None:
            if (self.shards is None) != (now.shards is None):
                return ["dataset layout (one file ↔ a directory or glob of shards)"]
            return _file_differences(self, now, "dataset")
        differences = []
        if added := [name for name in now.shards if name not in self.shards]:
            differences.append(f"shards added: {', '.join(added)}")
        if removed := [name for name in self.shards if name not in now.shards]:
            differences.append(f"shards removed: {', '.join(removed)}")
        for name, old in self.shards.items():
            if name in now.shards:
                differences += _file_differences(old, now.shards[name], f"shard {name}")
        return differences


def _file_differences(old: DatasetFingerprint, now: DatasetFingerprint, what: str) -> list[str]:
    """How one file changed, in words (``what``: ``dataset`` or ``shard NAME``)."""
    if old.size != now.size:
        return [f"{what} size {old.size} → {now.size} bytes"]
    if old.sample_sha256 != now.sample_sha256:
        return [f"{what} content (its first or last MiB)"]
    if old.mtime_ns != now.mtime_ns:
        return [f"{what} modification time (same size and first/last MiB: touched, copied or edited in place?)"]
    return []


def fingerprint_dataset(path: Path) -> DatasetFingerprint:
    """Fingerprint the dataset ``path``: a file, or every shard of a directory or glob
    (:func:`batchgen.io.shards.list_shards`).

    Raises:
        BatchgenError: the dataset cannot be read.
    """
    shards = list_shards(path)
    if shards.root is None:
        return _fingerprint_file(path)
    parts = {shards.name(shard): _fingerprint_file(shard) for shard in shards.paths}
    digest = hashlib.sha256("\n".join(f"{name} {part.to_json()}" for name, part in parts.items()).encode())
    return DatasetFingerprint(
        size=sum(part.size for part in parts.values()),
        mtime_ns=max(part.mtime_ns for part in parts.values()),
        sample_sha256=digest.hexdigest(),
        shards=parts,
    )


def _fingerprint_file(path: Path) -> DatasetFingerprint:
    try:
        with open(path, "rb") as f:
            stat = os.fstat(f.fileno())
            digest = hashlib.sha256()
            digest.update(f.read(SAMPLE_BYTES))
            if stat.st_size > SAMPLE_BYTES:
                # The last MiB, or the part of it not already hashed as the first one.
                f.seek(max(SAMPLE_BYTES, stat.st_size - SAMPLE_BYTES))
                digest.update(f.read(SAMPLE_BYTES))
    except OSError as e:
        raise BatchgenError(f"{path}: cannot read: {e.strerror or e}") from None
    return DatasetFingerprint(size=stat.st_size, mtime_ns=stat.st_mtime_ns, sample_sha256=digest.hexdigest())
