"""Each part file of a partial output records the settings of the run that wrote it; a resume holds them against the
manifest's, so that a part copied in from another output (found by a helper: its rows were merged, and the output's
metadata named the manifest's settings) is not taken as this job's."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pyarrow as pa

from batchgen.errors import BatchgenError
from batchgen.io.finished_output import schema_metadata
from batchgen.io.input_digests import INPUT_DIGESTS_KEY
from batchgen.io.partial_output import PartialState
from batchgen.job.run_metadata import DATASET_KEY, RUN_SEED_KEY, job_differences

# The settings a --resume-force kept parts of, whatever they differ in: a JSON list of the distinct settings_digest
# values of the parts present at each forced resume, one per settings record (found by a review: the names of the
# parts it kept, recorded before, grew with the job, in every part written after).
KEPT_SETTINGS_KEY = "batchgen.kept_settings"


def settings_digest(metadata: dict[str, str]) -> str:
    """16 hex digits of a SHA-256 of a part's record of its run's settings: its metadata but for what differs between
    the parts of one job (the dataset's fingerprint, its rows' digests, the kept settings themselves)."""
    ignored = (DATASET_KEY, INPUT_DIGESTS_KEY, KEPT_SETTINGS_KEY)
    kept = {key: value for key, value in sorted(metadata.items()) if key not in ignored}
    return hashlib.sha256(json.dumps(kept).encode()).hexdigest()[:16]


def foreign_parts(state: PartialState, recorded: pa.Schema) -> list[tuple[Path, list[str]]]:
    """The parts of ``state`` whose settings differ from those the manifest ``recorded`` (as a run's are held against
    them: :func:`~batchgen.job.run_metadata.job_differences`, and the run seed, which a run without ``--seed``
    drew), each with the differences as ``old → new`` phrases; not those whose settings a ``--resume-force`` kept
    (:func:`settings_digest`). The dataset is not compared: its rows are checked by digest."""
    manifest = schema_metadata(recorded)
    kept = set(json.loads(manifest.get(KEPT_SETTINGS_KEY, "[]")))
    found = []
    for path, schema in state.part_schemas:
        part = schema_metadata(schema)
        if settings_digest(part) in kept:
            continue
        differences = job_differences(part | {DATASET_KEY: manifest.get(DATASET_KEY, "")}, manifest)
        seeds = [json.loads(record.get("batchgen.engine_options", "{}")).get("seed") for record in (part, manifest)]
        if part.get(RUN_SEED_KEY) != manifest.get(RUN_SEED_KEY) and seeds[0] == seeds[1]:  # else said as the seed
            differences.append(f"run seed {part.get(RUN_SEED_KEY)} → {manifest.get(RUN_SEED_KEY)}")
        if differences:
            found.append((path, differences))
    return found


def check_parts_settings(state: PartialState, recorded: pa.Schema, force: bool) -> list[str]:
    """Refuse to resume from a part of :func:`foreign_parts`, unless ``force``, which warns and keeps it. Returns the
    settings digests to record as kept (:data:`KEPT_SETTINGS_KEY`): the manifest's, and under ``force`` those of
    every part there, since the forced run's settings replace the manifest's (found by a review: a later
    ``--resume`` refused the parts it had kept).

    Raises:
        BatchgenError: one line naming the first such part and every difference.
    """
    kept = json.loads(schema_metadata(recorded).get(KEPT_SETTINGS_KEY, "[]"))
    for path, differences in foreign_parts(state, recorded):
        if not force:
            raise BatchgenError(
                f"{path}: cannot resume: this part was written with other settings than the partial output's: "
                f"{'; '.join(differences)} (delete the part to run its rows again, pass --resume-force to keep it, "
                "or --overwrite to start over)"
            )
        print(f"batchgen: warning: {path}: kept despite: {'; '.join(differences)}", file=sys.stderr)
    if force:
        kept += [settings_digest(schema_metadata(schema)) for _, schema in state.part_schemas]
    return sorted(set(kept))
