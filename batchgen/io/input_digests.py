"""Digests of the input rows an output was made from (a finished output's in its metadata, a partial one's in its
parts: :mod:`batchgen.io.part_file`), so that ``--resume`` can add the rows it lacks and tell which of its rows were
made from an input that has changed since.

A row's digest is the first 8 bytes of the BLAKE2b hash of its id and its fields as canonical JSON (keys sorted),
so a change to any field of the row, its sampling fields included, or to which row holds an id, changes it, and
rewriting the file with other spacing or key order does not. The output's metadata holds the digests of every row
the run read, 8 bytes each, as base64, in input order. The file stores its metadata twice (Arrow IPC: header and
footer; Parquet: its own and in the Arrow schema), so they add about 2 MiB per 100,000 rows; a run of more than
:data:`MAX_DIGESTED_ROWS` rows records none (its output is then checked by the dataset file's fingerprint alone, as
an older batchgen's). Two different rows share a digest with a chance of about 2**-64 per pair, which is what the
check may miss.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.errors import RowError
from batchgen.io.input_options import InputOptions
from batchgen.io.input_row import InputRow
from batchgen.io.reader import RowReader
from batchgen.io.row_ids import NO_ID, claims_id, error_row_id

# Output metadata key of the digests.
INPUT_DIGESTS_KEY = "batchgen.input_digests"
DIGEST_BYTES = 8
# Parquet readers refuse a footer whose strings pass 100 MB (pyarrow's thrift limit: 8M rows' digests, stored twice,
# did); 1M rows keep the metadata near 21 MB, readable by every reader.
MAX_DIGESTED_ROWS = 1_000_000


def row_digest(rid: str, data: dict[str, Any]) -> bytes:
    """The :data:`DIGEST_BYTES`-byte digest of the input row ``data`` whose id is ``rid`` (see the module
    docstring); values JSON cannot write (Parquet dates, bytes) are hashed as Python shows them."""
    text = json.dumps([rid, data], sort_keys=True, ensure_ascii=False, default=repr)
    # A lone surrogate is a bad row, but it still gets a digest: hashed as its code unit.
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=DIGEST_BYTES).digest()


def encode_digests(digests: bytes) -> str:
    """``digests`` (concatenated :func:`row_digest` values) as the text the metadata holds."""
    return base64.b64encode(digests).decode("ascii")


def decode_digests(text: str) -> bytes:
    """The concatenated digests :func:`encode_digests` wrote as ``text``.

    Raises:
        ValueError: ``text`` is not what :func:`encode_digests` writes.
    """
    try:
        digests = base64.b64decode(text, validate=True)
    except binascii.Error as e:
        raise ValueError(f"not input digests: {e}") from None
    if len(digests) % DIGEST_BYTES:
        raise ValueError(f"not input digests: {len(digests)} bytes")
    return digests


def split_digests(digests: bytes) -> list[bytes]:
    """Concatenated digests, one by one."""
    return [digests[i : i + DIGEST_BYTES] for i in range(0, len(digests), DIGEST_BYTES)]


def _as_array(digests: bytes) -> pa.Array:
    """Concatenated digests as a uint64 array, for set lookups in pyarrow."""
    return pa.Array.from_buffers(pa.uint64(), len(digests) // DIGEST_BYTES, [None, pa.py_buffer(digests)])


def compare_rows(
    dataset: Path, out_ids: list[str], recorded: str, options: InputOptions | None = None
) -> tuple[list[str], list[str], int]:
    """Compare an output with ids ``out_ids`` (in its order) and input digests ``recorded`` (:func:`encode_digests`'
    text) with ``dataset`` as it is now, read with the column ``options`` the run used: the output's ids whose input
    row is not one ``recorded`` holds (in dataset order), those whose input row is gone (in output order), and the
    number of the dataset's ids the output lacks.

    The first row that claims an id (:func:`~batchgen.io.row_ids.claims_id`) is the one its output row was made from
    and is compared (a later one is a duplicate, a bad row; a row that claims none, an unreadable line among them, is
    an error row, which --resume reads again anyway); an id no row claims is gone.

    Raises:
        ValueError: ``recorded`` is not what :func:`encode_digests` writes.
        BatchgenError: the dataset cannot be read.
    """
    stored = decode_digests(recorded)
    have, seen, claimed = set(out_ids), set(), set()
    ids, digests = [], bytearray()
    for (rid, claims, _), item in _identified(dataset, options):
        if claims and rid in have and rid not in claimed and isinstance(item, InputRow):  # claims: a readable row
            ids.append(rid)
            digests += row_digest(rid, item.data)
        seen.add(rid)
        if claims:
            claimed.add(rid)
    found = pc.is_in(_as_array(bytes(digests)), value_set=_as_array(stored)).to_pylist()
    changed = [rid for rid, same in zip(ids, found) if not same]
    # An id no row claims now is gone, though rows that claim none (a null or bad id) have its text.
    gone = list(dict.fromkeys(rid for rid in out_ids if rid not in claimed))
    return changed, gone, len(seen - have)


# The digest of a row whose input is not known (never a row's: a 2**-64 chance), so that it reads as changed.
UNKNOWN_DIGEST = bytes(DIGEST_BYTES)


def compare_each(
    dataset: Path, ids: Collection[str], recorded: Mapping[str, bytes], options: InputOptions | None = None
) -> tuple[list[str], list[str]]:
    """Compare each of an output's rows ``ids`` with the input digest ``recorded`` for it (none: changed) with the
    row that claims the id in ``dataset`` as it is now (read with the column ``options``): the ids whose input
    changed (in dataset order) and those no row claims now (gone).

    Raises:
        BatchgenError: the dataset cannot be read.
    """
    now = digests_now(dataset, ids, options) if ids else {}
    changed = [rid for rid, digest in now.items() if digest != recorded.get(rid, UNKNOWN_DIGEST)]
    return changed, [rid for rid in ids if rid not in now]


def digests_now(dataset: Path, ids: Collection[str], options: InputOptions | None = None) -> dict[str, bytes]:
    """The digest of the row of ``dataset`` (read with the column ``options``) that claims each of ``ids`` now, in
    dataset order; an id no readable row claims is left out.

    Raises:
        BatchgenError: the dataset cannot be read.
    """
    wanted, found = set(ids), {}
    for (rid, claims, _), item in _identified(dataset, options):
        if claims and rid in wanted and rid not in found and isinstance(item, InputRow):
            found[rid] = row_digest(rid, item.data)
    return found


class RunDigests:
    """The input digests a run records: every row's, in input order, for the finished output's metadata (up to
    :data:`MAX_DIGESTED_ROWS` rows), and those of the rows read but not yet written, for the part that takes their
    samples (:mod:`batchgen.io.part_file`).

    Memory: 8 bytes per row read, plus one dict entry per row in flight.
    """

    def __init__(self) -> None:
        self._all = bytearray()
        self._unwritten: dict[str, bytes] = {}

    def claim(self, row: InputRow, rid: str, runs: bool) -> None:
        """Record the digest of ``row``, the row that claims ``rid`` (a duplicate's would let a later edit that makes
        the duplicate the claiming row pass as unchanged), and keep it for its part when it ``runs``."""
        digest = row_digest(rid, row.data)
        if runs:
            self._unwritten[rid] = digest
        if len(self._all) <= MAX_DIGESTED_ROWS * DIGEST_BYTES:  # past the limit, one more says "too many"
            self._all += digest

    def drop(self, rid: str) -> None:
        """Forget the digest of a row that ran and failed: no part takes samples of it."""
        self._unwritten.pop(rid, None)

    def written(self, sample_ids: Iterable[str]) -> bytes:
        """The digests of the rows ``sample_ids`` (a part's rows with samples, each id once), in that order,
        forgotten here (:data:`UNKNOWN_DIGEST` for a row not claimed here, which a later check finds changed)."""
        return b"".join(self._unwritten.pop(rid, UNKNOWN_DIGEST) for rid in sample_ids)

    def metadata(self) -> dict[str, str]:
        """The finished output's metadata entry (none past :data:`MAX_DIGESTED_ROWS` rows)."""
        if len(self._all) > MAX_DIGESTED_ROWS * DIGEST_BYTES:
            return {}
        return {INPUT_DIGESTS_KEY: encode_digests(bytes(self._all))}


class InputId(NamedTuple):
    """An input row's id as its output row has it, whether the row claims it (:func:`~batchgen.io.row_ids.claims_id`:
    a row that does not is an error row, beside the row that does), and where the row is (``file:line``, as its
    error row's message begins)."""

    id: str
    claims: bool
    where: str


def input_ids(dataset: Path, options: InputOptions | None = None) -> Iterator[InputId]:
    """The id of each row of ``dataset``, in order, as a run with the column ``options`` gives it to its output row
    (the row's ``id``, or its ``--id-column``'s value, else its index; a line that is not a JSON object, as
    :data:`~batchgen.io.row_ids.NO_ID`), with whether it claims it and where it is.

    Raises:
        BatchgenError: the dataset cannot be read.
    """
    for found, _ in _identified(dataset, options):
        yield found


def _identified(dataset: Path, options: InputOptions | None) -> Iterator[tuple[InputId, InputRow | RowError]]:
    """Each row of ``dataset`` with its :class:`InputId`."""
    reader = RowReader(dataset, options=options)
    for item in reader:
        rid = NO_ID if isinstance(item, RowError) else error_row_id(item)
        yield InputId(rid, claims_id(item, reader.index_ids), f"{item.source or reader.source}:{item.line}"), item
