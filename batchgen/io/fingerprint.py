"""A cheap fingerprint of the dataset, so that a resumed run can tell whether its input changed.

The fingerprint is the file's size, its modification time and a SHA-256 of its first and last MiB (the whole file
when it is at most 2 MiB). It costs two 1 MiB reads whatever the dataset's size, where a hash of the whole file
would read every byte again at every resume (minutes for a multi-GB dataset). What it catches: appended, removed
or truncated rows (size, last MiB), edits at either end (the hashes), and any edit that rewrites the file
(modification time). What it may miss: a same-size edit in the middle written with the old modification time
restored. What may flag a change that is none: a copy or ``touch`` that changes only the modification time;
``--resume-force`` accepts that.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from batchgen.errors import BatchgenError

SAMPLE_BYTES = 1 << 20


@dataclass(frozen=True)
class DatasetFingerprint:
    """What identifies one version of a dataset file (see the module docstring)."""

    size: int
    mtime_ns: int
    sample_sha256: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DatasetFingerprint:
        """Parse :meth:`to_json`'s output.

        Raises:
            ValueError: not a fingerprint.
        """
        try:
            data = json.loads(text)
            return cls(size=int(data["size"]), mtime_ns=int(data["mtime_ns"]), sample_sha256=str(data["sample_sha256"]))
        except (TypeError, KeyError, json.JSONDecodeError) as e:
            raise ValueError(f"not a dataset fingerprint: {e}") from None

    def differences(self, now: DatasetFingerprint) -> list[str]:
        """How the dataset changed from ``self`` (recorded) to ``now``, in words; empty when it did not."""
        if self.size != now.size:
            return [f"dataset size {self.size} → {now.size} bytes"]
        if self.sample_sha256 != now.sample_sha256:
            return ["dataset content (its first or last MiB)"]
        if self.mtime_ns != now.mtime_ns:
            return ["dataset modification time (same size and first/last MiB: touched, copied or edited in place?)"]
        return []


def fingerprint_dataset(path: Path) -> DatasetFingerprint:
    """Fingerprint the file ``path``.

    Raises:
        BatchgenError: the file cannot be read.
    """
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
