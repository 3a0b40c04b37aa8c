"""``OUT.partial/``: the work in progress of one output file, made durable part by part, and turned into OUT.

Layout (``OUT`` is e.g. ``results.arrow``)::

    results.arrow.partial/
        manifest.json                      the job: its output schema, whose metadata records model, dtype,
                                           sampling defaults, engine options, logprobs mode, dataset fingerprint
                                           and run seed; a SHA-256 of its own content; written atomically
                                           (``manifest.py``)
        part-000000-<16 hex>.arrow         finished rows, one Arrow IPC file per flush; the hex digits are the
        part-000001-<16 hex>.arrow         first 16 of the file's own SHA-256; each records the digests of the
                                           input rows it holds (``part_file.py``)
        part-000002.tmp                    a part being written (left by a crash; deleted on resume)
        lock                               flock'ed by the run that writes the directory

Flush protocol: a part goes to ``part-N.tmp``, is fsynced, renamed to ``part-N-<hash>.arrow``, and the directory
is fsynced; a crash at any instant leaves either no part N or a complete one. A part counts only when its bytes
hash to the digits in its name and open as an Arrow IPC file, so a torn, truncated or corrupted part is detected
(never read as data), dropped on resume, and its rows generated again. The parts are in Arrow IPC whatever
OUT's format: :func:`batchgen.io.assemble.assemble_output` writes OUT's format at the end.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.errors import BatchgenError, OutputError
from batchgen.io.assemble import assemble_output
from batchgen.io.done_rows import DoneRows
from batchgen.io.durable import fsync_dir, fsync_file, write_atomically
from batchgen.io.manifest import encode_manifest, read_manifest
from batchgen.io.output_lock import LOCK, take_lock
from batchgen.io.part_file import PART, encode_part, job_schema, part_digests, part_name, read_part, write_part_file

MANIFEST = "manifest.json"
_TORN = re.compile(r"part-\d+\.tmp")
# Temporary files that hold no rows: a manifest being replaced, OUT being assembled.
_LEFTOVER = re.compile(r"manifest\.json\.tmp|final\..*")


def partial_dir(out: Path) -> Path:
    """The directory that holds ``out``'s work in progress."""
    return out.with_name(out.name + ".partial")


@dataclass
class PartialState:
    """What a partial output directory holds (see :meth:`PartialOutput.inspect`).

    Attributes:
        schema: the job's output schema, from the manifest, else from the latest valid part; ``None`` if neither.
        manifest_damaged: the manifest exists but is unreadable or fails its checksum.
        parts: the valid parts, ``(number, path)`` in order.
        damaged: torn or corrupted parts and temporary part files, to be deleted.
        done: the rows the valid parts hold.
        next_part: the number of the next part to write.
        listing: the directory's files and sizes when inspected (to notice another run changing them).
        input_digests: the input digest of each id with samples, that of the part whose samples count (the latest
            part holding some), or ``None`` when a valid part records none (an older batchgen wrote it).
        part_schemas: the job's schema as each valid part records it, ``(path, schema)``: the settings of the run
            that wrote it, which a resume holds against the manifest's.
    """

    schema: pa.Schema | None = None
    manifest_damaged: bool = False
    parts: list[tuple[int, Path]] = field(default_factory=list)
    damaged: list[Path] = field(default_factory=list)
    done: DoneRows = field(default_factory=DoneRows)
    next_part: int = 0
    listing: frozenset[tuple[str, int]] = frozenset()
    input_digests: dict[str, bytes] | None = None
    part_schemas: list[tuple[Path, pa.Schema]] = field(default_factory=list)


class PartialOutput:
    """Writes the part files of ``out`` and assembles ``out`` from them; one instance per run."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.dir = partial_dir(out)
        self.state = PartialState()
        self._lock_fd: int | None = None
        self._broken = False

    def exists(self) -> bool:
        return self.dir.is_dir()

    def inspect(self) -> PartialState:
        """Read the directory without changing it.

        Raises:
            BatchgenError: the directory cannot be read.
        """
        state = PartialState()
        try:
            state.listing = _listing(self.dir)
            state.schema, state.manifest_damaged = read_manifest(self.dir / MANIFEST)
            numbered = []
            for path in self.dir.iterdir():
                match = PART.fullmatch(path.name)
                if match:
                    numbered.append((int(match[1]), match[2], path))
                elif _TORN.fullmatch(path.name):
                    state.damaged.append(path)
            last_schema = None
            digests: dict[str, bytes] | None = {}
            for number, digest, path in sorted(numbered):
                state.next_part = max(state.next_part, number + 1)
                table = read_part(path, digest)
                if table is None:
                    state.damaged.append(path)
                    continue
                state.parts.append((number, path))
                state.done.add_part(number, table)
                last_schema = job_schema(table)
                state.part_schemas.append((path, last_schema))
                recorded = part_digests(table) if digests is not None else None
                digests = None if recorded is None or digests is None else digests | recorded
        except OSError as e:
            raise BatchgenError(f"{self.dir}: cannot read the partial output: {e.strerror or e}") from None
        state.input_digests = digests
        if state.schema is None:
            # A damaged manifest is rebuilt from the parts: each carries the job's schema and metadata.
            state.schema = last_schema
        return state

    def start(self, schema: pa.Schema, state: PartialState | None) -> None:
        """Open the directory for this run's parts: afresh (``state`` is ``None``: earlier content is removed)
        or continuing ``state`` from :meth:`inspect` (its damaged files are deleted).

        Raises:
            BatchgenError: the directory or manifest cannot be written, or another run holds the lock; OutputError:
                another run changed the partial output since it was inspected.
        """
        try:
            if not self.dir.exists():
                self.dir.mkdir()
                fsync_dir(self.dir.parent)
            self.lock()
            if state is not None and _listing(self.dir) != state.listing:
                raise OutputError(f"{self.dir}: another run changed the partial output meanwhile; rerun with --resume")
            if state is None:
                _remove_contents(self.dir)
                state = PartialState()
            for path in [*state.damaged, *(p for p in self.dir.iterdir() if _LEFTOVER.fullmatch(p.name))]:
                path.unlink(missing_ok=True)
            state.damaged = []
            if state.schema is None or state.manifest_damaged or not state.schema.equals(schema, check_metadata=True):
                write_atomically(self.dir / MANIFEST, encode_manifest(schema))
            fsync_dir(self.dir)
        except OSError as e:
            raise BatchgenError(f"{self.dir}: cannot write the partial output: {e.strerror or e}") from None
        state.schema, state.manifest_damaged = schema, False
        self.state = state

    def write_part(self, rows: list[dict[str, Any]], digests: bytes | None) -> None:
        """Make ``rows`` durable as the next part (nothing for no rows), recording the input ``digests`` of those
        with samples (:func:`~batchgen.io.input_digests.row_digest`, concatenated in the order of
        :func:`~batchgen.io.part_file.sample_ids`; ``None``: not known, so a resume from a changed dataset cannot check
        them). The caller hands over whole rows: all samples of a row in one call.

        Raises:
            OutputError: the file system failed (disk full, no permission); every part written before stays
                valid, and this output takes no more parts. BatchgenError: an earlier part failed.
            pyarrow.ArrowInvalid, pyarrow.ArrowTypeError: a value does not fit its column.
        """
        if self._broken:
            raise BatchgenError(f"{self.dir}: an earlier part failed to write")
        if not rows:
            return
        assert self.state.schema is not None, "start() first"
        data = encode_part(rows, self.state.schema, digests)
        number = self.state.next_part
        temp = self.dir / f"part-{number:06d}.tmp"
        final = self.dir / part_name(number, data)
        try:
            write_part_file(temp, data)
            os.replace(temp, final)
            fsync_dir(self.dir)
        except OSError as e:
            self._broken = True  # the rename may have happened: writing the same rows again could duplicate them
            with contextlib.suppress(OSError):  # a stray temporary file is dropped on resume anyway
                temp.unlink(missing_ok=True)
            raise OutputError(
                f"{self.dir}: cannot write part {number}: {e.strerror or e}; the rows flushed before are kept "
                "(fix that, then rerun with --resume)"
            ) from None
        self.state.next_part += 1
        self.state.parts.append((number, final))
        self.state.done.note_written(number, [row["id"] for row in rows if row.get("finish_reason") != "error"])

    def finalize(self, metadata: dict[str, str], render: Callable[[Path, Path], None] | None = None) -> int:
        """Assemble ``out`` from the parts, with ``metadata`` added to the job's, put it in place atomically, and
        remove the directory. With ``render``, the rows are assembled as an Arrow IPC file, and ``render(that
        file, path)`` writes ``out``'s content to ``path`` (OpenAI Batch lines: :mod:`batchgen.io.openai_output`).

        Returns the number of rows assembled.

        Raises:
            OutputError: ``out`` cannot be written (it is then absent, and the parts stay for ``--resume``).
        """
        assert self.state.schema is not None, "start() first"
        temp = self.dir / f"final{self.out.suffix}"
        try:
            schema = self.state.schema.with_metadata({**(self.state.schema.metadata or {}), **metadata})
            assembled = self.dir / "final.assembled.arrow" if render is not None else temp
            rows = assemble_output(self.state.parts, schema, self.state.done, assembled)
            if render is not None:
                render(assembled, temp)
                fsync_file(temp)
                assembled.unlink()
            os.replace(temp, self.out)
            fsync_dir(self.out.parent)
        except (OSError, BatchgenError, ValueError, pa.ArrowException) as e:
            with contextlib.suppress(OSError):
                temp.unlink(missing_ok=True)
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise OutputError(
                f"{self.out}: cannot write the output: {reason}; every row is kept in {self.dir} "
                "(fix that, then rerun with --resume)"
            ) from None
        # OUT is complete now; a directory that cannot be removed is removed by the next --resume (which finds
        # OUT complete and nothing to do). Removed under the lock: a run that took it in between would have its
        # own parts removed (found by a helper).
        try:
            with contextlib.suppress(OSError):
                remove_partial_dir(self.dir)
        finally:
            self.close()
        return rows

    def close(self) -> None:
        """Release the lock (the directory stays, for ``--resume``)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def lock(self) -> None:
        """Take the directory's lock (it must exist) until :meth:`close`, so that no other run reads or writes it
        meanwhile, and ``batchgen status`` sees a run at work; nothing when this instance holds it already.

        Raises:
            BatchgenError: another run holds it, or the lock file cannot be opened.
        """
        if self._lock_fd is None:
            self._lock_fd = take_lock(self.dir)


def remove_partial_dir(directory: Path) -> None:
    """Delete a partial output directory: the files batchgen writes there, then the directory if it is empty.

    Raises:
        OSError: a file cannot be deleted.
    """
    if not directory.is_dir():
        return
    _remove_contents(directory)
    (directory / LOCK).unlink(missing_ok=True)
    try:
        directory.rmdir()
    except OSError:
        return  # it holds files batchgen did not write: they are left alone, and so is the directory
    fsync_dir(directory.parent)


def _remove_contents(directory: Path) -> None:
    """Delete the manifest, parts and temporary files (not the lock, which the caller may hold)."""
    for path in directory.iterdir():
        if path.name == MANIFEST or any(p.fullmatch(path.name) for p in (PART, _TORN, _LEFTOVER)):
            path.unlink()


def _listing(directory: Path) -> frozenset[tuple[str, int]]:
    if not directory.is_dir():
        return frozenset()
    return frozenset((p.name, p.stat().st_size) for p in directory.iterdir() if p.name != LOCK)
