"""``batchgen status DATASET OUT``: how far a run has got, from its partial output or its finished file.

Rows done are input rows the output accounts for: a row with its samples (counted once, whatever its ``n``), or
an error row (``--on-error skip``). Nothing is changed on disk, so it is safe next to a running job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.errors import BatchgenError
from batchgen.io.fingerprint import DatasetFingerprint, fingerprint_dataset
from batchgen.io.partial_output import PartialOutput, partial_dir
from batchgen.io.reader import count_input_rows
from batchgen.resume import DATASET_KEY


def output_status(dataset: Path, out: Path) -> list[str]:
    """The lines ``batchgen status`` prints: ``OUT: STATE: D of T rows done, R remaining, E errored``, then one
    line per note (a changed dataset, damaged part files).

    Raises:
        BatchgenError: the dataset or the output cannot be read.
    """
    total = count_input_rows(dataset)
    notes = []
    metadata: dict[bytes, bytes] = {}
    if out.exists():
        state = "complete"
        done, errored, metadata = _final_counts(out)
    elif partial_dir(out).is_dir():
        partial = PartialOutput(out).inspect()
        done, errored = partial.done.count, partial.done.error_rows
        state = f"in progress ({len(partial.parts)} part files in {partial_dir(out)})"
        metadata = (partial.schema.metadata or {}) if partial.schema is not None else {}
        if partial.damaged:
            notes.append(f"{len(partial.damaged)} torn or damaged part files (dropped on resume, their rows rerun)")
        if partial.manifest_damaged:
            notes.append("the manifest is damaged (rebuilt from the part files on resume)")
    else:
        state, done, errored = "not started", 0, 0
    if state == "complete" and DATASET_KEY.encode() not in metadata:
        # JSON Lines has no schema to carry the run's metadata (found by a new user: a finished output of another
        # dataset looked like this one's, "complete" with rows remaining).
        notes.append(f"{out} records no dataset fingerprint (JSONL has no metadata): it may come from another file")
    if DATASET_KEY.encode() in metadata:
        recorded = DatasetFingerprint.from_json(metadata[DATASET_KEY.encode()].decode())
        changes = recorded.differences(fingerprint_dataset(dataset))
        if changes:
            notes.append(f"{dataset} changed since the run started: {'; '.join(changes)}")
    remaining = max(total - done, 0)
    line = f"{out}: {state}: {done} of {total} rows done, {remaining} remaining, {errored} errored"
    if state == "complete" and remaining:
        line += " (rows left out as bad by --on-error fail are never written)"
    return [line, *(f"{out}: note: {note}" for note in notes)]


def _final_counts(path: Path) -> tuple[int, int, dict[bytes, bytes]]:
    """(rows done, error rows, schema metadata) of a finished output file, read batch by batch."""
    suffix = path.suffix.lower()
    done = errored = 0
    try:
        if suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        row = json.loads(line)
                        errored += row.get("finish_reason") == "error"
                        done += row.get("sample_index") == 0 or row.get("finish_reason") == "error"
            return done, errored, {}
        if suffix == ".parquet":
            parquet = pq.ParquetFile(path)
            metadata = parquet.schema_arrow.metadata or {}
            batches = parquet.iter_batches(columns=["sample_index", "finish_reason"])
        else:
            reader = pa.ipc.open_file(pa.memory_map(str(path)))
            metadata = reader.schema.metadata or {}
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        for batch in batches:
            first = pc.sum(pc.equal(batch.column("sample_index"), 0)).as_py() or 0
            errors = pc.sum(pc.equal(batch.column("finish_reason"), "error")).as_py() or 0
            done, errored = done + first + errors, errored + errors
    except (OSError, ValueError, KeyError, pa.ArrowException) as e:
        raise BatchgenError(f"{path}: cannot read results ({e})") from None
    return done, errored, metadata
