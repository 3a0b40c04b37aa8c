"""``--resume`` from a dataset that changed since the output's rows were made: each row with samples is checked
against the row that holds its id now, by the input digests the output records (:mod:`batchgen.io.input_digests`;
a partial output's parts record their own: :mod:`batchgen.io.part_file`). Rows whose input changed or left are
refused, not generated again, which would discard their results; ``--resume-force`` keeps them as they are."""

from __future__ import annotations

import json
import sys
from collections.abc import Collection
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa

from batchgen.errors import BatchgenError, counted
from batchgen.io.fingerprint import DatasetFingerprint, fingerprint_dataset
from batchgen.io.finished_output import finished_batches, finished_rows, schema_metadata
from batchgen.io.input_digests import INPUT_DIGESTS_KEY, compare_each, compare_rows
from batchgen.io.input_options import INPUT_OPTIONS_KEY, InputOptions, recorded_input_options
from batchgen.io.partial_output import PartialState
from batchgen.job.run_metadata import DATASET_KEY, changed_fields

# A message names at most this many row ids.
_IDS_SHOWN = 3


def check_finished_rows(dataset: Path, out: Path, force: bool, options: InputOptions | None = None) -> bool | None:
    """Before ``--resume`` reopens the finished Arrow IPC or Parquet output ``out`` to add the rows it lacks (called
    when it lacks rows or ``dataset`` changed since): check that each of its rows was made from the row ``dataset``
    (read with the column ``options``; ``None``: those ``out`` records) holds under its id now, and return whether
    ``out`` is complete; ``None`` when ``out`` records no digests (an older batchgen). An output with error rows is
    not complete: only a run that reads the whole dataset tells which of them still stand
    (:class:`batchgen.io.done_rows.DoneRows`; a bad row fixed since is generated).

    Raises:
        BatchgenError: ``out`` cannot be read, or rows changed (one line naming a few of their ids), unless ``force``.
    """
    try:
        schema, _ = finished_batches(out, ["id"])
        recorded = schema_metadata(schema).get(INPUT_DIGESTS_KEY)
        if recorded is None:
            return None
        options_then = recorded_input_options(schema.metadata or {})
        options = options if options is not None else options_then
        finished = finished_rows(out)
        changed, gone, missing = compare_rows(dataset, finished.ids, recorded, options)
    except (OSError, ValueError, pa.ArrowException) as e:
        raise BatchgenError(f"{out}: cannot read results ({e}); pass --overwrite to run the dataset again") from None
    _refuse_changed(
        [rid for rid in changed + gone if rid in finished.samples], dataset, out, options_then, options, force
    )
    return missing == 0 and not finished.errors


def check_partial_rows(dataset: Path, where: Path, state: PartialState, now: pa.Schema, force: bool) -> pa.Schema:
    """The schema the partial output ``state`` (in ``where``) records, with ``dataset``'s fingerprint as it is now when
    the dataset changed since and each row with samples was checked against it (read with the column options of
    this run's schema ``now``); as it is when the dataset did not change or the parts record no digests (an older
    batchgen's: the fingerprint alone is compared, :func:`batchgen.job.resume.check_same_job`).

    Raises:
        BatchgenError: rows changed (one line naming a few of their ids), unless ``force``; the dataset cannot be
            read.
    """
    assert state.schema is not None, "a partial output with a job"
    metadata = schema_metadata(state.schema)
    fingerprint = fingerprint_dataset(dataset)
    try:
        then = DatasetFingerprint.from_json(metadata[DATASET_KEY])
    except (KeyError, ValueError):  # no fingerprint recorded: check_same_job says so
        return state.schema
    if state.input_digests is None or not then.differences(fingerprint):
        return state.schema
    options_then = recorded_input_options(state.schema.metadata or {})
    options = recorded_input_options(now.metadata or {})
    changed, gone = compare_each(dataset, state.done.samples.keys(), state.input_digests, options)
    _refuse_changed([*changed, *gone], dataset, where, options_then, options, force)
    return state.schema.with_metadata(metadata | {DATASET_KEY: fingerprint.to_json()})


def _refuse_changed(
    changed: Collection[str], dataset: Path, where: Path, options_then: InputOptions, options: InputOptions, force: bool
) -> None:
    """Refuse the rows ``changed`` of the output ``where`` (their input changed or left ``dataset``) in one line
    naming a few of them, or with ``force`` warn that they are kept.

    Raises:
        BatchgenError: ``changed`` is not empty, unless ``force``.
    """
    if not changed:
        return
    ids = list(changed)
    shown = ", ".join(f"'{rid}'" for rid in ids[:_IDS_SHOWN])
    if len(ids) > _IDS_SHOWN:
        shown += f" and {len(ids) - _IDS_SHOWN} more"
    rows = f"{counted(len(ids), 'row')} of {where} changed in {dataset} or left it since it was made ({shown})"
    # Other column options make other prompts from the same rows: say so, not only that the rows changed.
    then = {INPUT_OPTIONS_KEY: json.dumps(asdict(options_then))}
    if options_differ := changed_fields(
        INPUT_OPTIONS_KEY, then, {INPUT_OPTIONS_KEY: json.dumps(asdict(options))}, None
    ):
        rows += f", read with other column options ({'; '.join(options_differ)})"
    if not force:
        raise BatchgenError(
            f"cannot resume: the input of {rows}; --resume does not generate them again, which would discard their "
            "results: pass --resume-force to keep them as they are and add any missing rows, or --overwrite to run "
            "the whole dataset again"
        )
    print(f"batchgen: warning: the input of {rows}; --resume-force keeps their results", file=sys.stderr)
