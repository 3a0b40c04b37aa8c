"""Whether a run may start, continue, reopen or skip its output: the output path checks, the comparison of this run with
the one that wrote a partial output, and the command that resumes an interrupted run."""

from __future__ import annotations

import contextlib
import json
import secrets
import shlex
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pyarrow as pa

from batchgen.errors import BatchgenError
from batchgen.io.fingerprint import fingerprint_dataset
from batchgen.io.finished_output import finished_batches, finished_rows, schema_metadata
from batchgen.io.input_digests import (
    INPUT_DIGESTS_KEY,
    UNKNOWN_DIGEST,
    decode_digests,
    digests_now,
    split_digests,
)
from batchgen.io.input_options import recorded_input_options
from batchgen.io.output_format import check_output_format
from batchgen.io.output_lock import WRITING, held_by_a_run
from batchgen.io.partial_output import PartialOutput, PartialState, partial_dir, remove_partial_dir
from batchgen.io.reopen import reopen_output
from batchgen.io.shards import is_read_as_shard, reads_part_files
from batchgen.job.changed_rows import check_partial_rows
from batchgen.job.options import JobOptions
from batchgen.job.output_columns import check_written_rows, columns_for_resume
from batchgen.job.part_settings import KEPT_SETTINGS_KEY, check_parts_settings
from batchgen.job.run_metadata import DATASET_KEY, RUN_SEED_KEY, job_differences


def check_output_place(dataset: Path, out: Path) -> None:
    """Check that ``out`` can be the output of a run of ``dataset``: not the dataset itself, nor a directory, a format
    batchgen writes, in a directory that exists, and nothing a later run of the dataset would read as a shard
    (``out``, its partial output's files).

    Raises:
        BatchgenError: one line naming ``out`` and what is wrong.
    """
    if out.exists() and dataset.exists() and out.resolve() == dataset.resolve():
        raise BatchgenError(f"{out}: the output file is the input dataset; choose another --out")
    if out.is_dir():  # before its format: a directory's name has no extension (found by a new user)
        raise BatchgenError(f"{out}: is a directory, expected an output file")
    check_output_format(out)
    if not out.parent.exists():
        raise BatchgenError(f"{out}: directory {out.parent} does not exist")
    if is_read_as_shard(dataset, out):
        raise BatchgenError(f"{out}: a later run would read the output as a shard of {dataset}; write it elsewhere")
    partial = partial_dir(out)
    # Its part files, and the file it is assembled as before it is moved into place (a crash can leave it).
    if reads_part_files(dataset, partial) or is_read_as_shard(dataset, partial / f"final{out.suffix}"):
        raise BatchgenError(
            f"{out}: a later run would read the files of its partial output ({partial}/) as shards of {dataset}; "
            "write it elsewhere"
        )


def check_output_path(dataset: Path, out: Path, overwrite: bool, resume: bool) -> bool:
    """Check the output path before any work; return whether ``out`` is a finished output to check for missing rows
    (only with ``resume``; once it passes, :func:`discard_partial_beside` removes a partial output left beside it).

    Raises:
        BatchgenError: :func:`check_output_place`'s errors; ``out`` or its partial output exists without
            ``overwrite`` or ``resume`` (which exclude each other: :meth:`JobOptions.validate`).
    """
    check_output_place(dataset, out)
    if out.exists() and not (overwrite or resume):
        raise BatchgenError(
            f"{out}: output file exists; pass --resume to finish or keep it, or --overwrite to replace it"
        )
    partial = partial_dir(out)
    if partial.exists() and held_by_a_run(partial):  # found by a helper: told to --resume an "interrupted" run
        raise BatchgenError(f"{partial}: {WRITING}")
    if partial.exists() and not (overwrite or resume or out.exists()):
        raise BatchgenError(
            f"{partial}: an interrupted run's partial output is there; pass --resume to continue it, "
            "or --overwrite to start over"
        )
    return resume and out.exists()


def discard_partial_beside(out: Path) -> None:
    """Remove the partial output beside the finished output ``out``, once ``--resume`` has checked ``out`` (a file no
    run wrote, or one of another dataset, is refused first, and a run's partial output beside it kept). ``out`` is
    only ever put in place finished, and removed only once reopened; a partial output beside it is what a crash
    between putting it in place and removing the directory leaves, or one while it was being reopened.

    Raises:
        BatchgenError: a run holds its lock: one reopening ``out`` now, whose parts hold its rows until it removes
            ``out`` (found by a helper's review), or one putting ``out`` in place.
    """
    partial = PartialOutput(out)
    if not partial.exists():
        return
    partial.lock()
    try:
        with contextlib.suppress(OSError):
            remove_partial_dir(partial.dir)
    finally:
        partial.close()


def open_output(
    dataset: Path, output: PartialOutput, schema: pa.Schema, seed: int | None, job: JobOptions
) -> tuple[pa.Schema, PartialState | None]:
    """The run's output schema (:func:`output_schema`) and the partial output it continues (``None``: it starts
    afresh). With ``job.resuming`` that is ``output``'s partial output; or, when the finished output is there (one
    that lacks rows, which ``check_nothing_left`` let through), the finished output, checked against this run as a
    partial output is, then reopened as one (:func:`batchgen.io.reopen.reopen_output`). A partial output it reads
    is locked first (:meth:`PartialOutput.lock`), and stays so until the run closes ``output``.

    Raises:
        BatchgenError: :func:`output_schema`'s errors; the partial output cannot be read or another run holds its
            lock, or the finished output cannot be reopened.
    """
    if job.resuming and output.out.exists():
        try:
            recorded, _ = finished_batches(output.out)
        except (OSError, pa.ArrowException) as e:
            raise BatchgenError(f"{output.out}: cannot read results ({e})") from None
        # Its rows were checked against the dataset as it is now, row by row: the file's fingerprint is that one.
        metadata = schema_metadata(recorded) | {DATASET_KEY: fingerprint_dataset(dataset).to_json()}
        digests = metadata.pop(INPUT_DIGESTS_KEY, None)
        recorded = recorded.with_metadata(metadata)
        finished = lambda: finished_batches(output.out)[1]  # noqa: E731
        schema = output_schema(schema, dataset, seed, recorded, job.resume_force, output.out, finished)
        check_written_rows(finished(), recorded, schema, output.out)
        reopen_output(output, schema, _reopened_digests(dataset, output.out, digests, schema))
        return schema, output.inspect()
    resumed = None
    if job.resuming and output.exists():
        output.lock()
        resumed = output.inspect()
    report_damage(output.dir, resumed)
    recorded = None
    kept: list[str] = []  # the settings a --resume-force kept parts of (part_settings)
    if resumed is not None and resumed.schema is not None:
        # Its rows are checked one by one against a dataset that changed: the fingerprint is then the one now.
        recorded = check_partial_rows(dataset, output.dir, resumed, schema, job.resume_force)
        kept = check_parts_settings(resumed, recorded, job.resume_force)
    parts = lambda: _part_batches(resumed) if resumed is not None else iter(())  # noqa: E731
    schema = output_schema(schema, dataset, seed, recorded, job.resume_force, output.dir, parts)
    if kept:  # recorded, so that a later --resume takes those parts as they are
        schema = schema.with_metadata(schema_metadata(schema) | {KEPT_SETTINGS_KEY: json.dumps(kept)})
    if recorded is not None:
        check_written_rows(parts(), recorded, schema, output.dir)
    return schema, resumed


def _reopened_digests(dataset: Path, out: Path, recorded: str | None, schema: pa.Schema) -> dict[str, bytes] | None:
    """The digest of each row with samples of the finished output ``out`` that its reopened parts record: its input
    row's now, where that is one the output records (:data:`~batchgen.io.input_digests.UNKNOWN_DIGEST` for a row
    ``--resume-force`` kept although its input changed, or one that changed since it was checked, so that a later
    resume names it as a partial output's parts would); ``None`` where ``out`` records no digests (``recorded``).

    Raises:
        BatchgenError: the dataset cannot be read.
    """
    if recorded is None:
        return None
    known = set(split_digests(decode_digests(recorded)))
    now = digests_now(dataset, finished_rows(out).samples, recorded_input_options(schema.metadata or {}))
    return {rid: digest if digest in known else UNKNOWN_DIGEST for rid, digest in now.items()}


def _part_batches(state: PartialState) -> Iterator[pa.RecordBatch]:
    """The rows of ``state``'s valid parts, part after part."""
    for _, path in state.parts:
        yield from pa.ipc.open_file(pa.memory_map(str(path))).read_all().to_batches()


def output_schema(
    schema: pa.Schema,
    dataset: Path,
    seed: int | None,
    recorded: pa.Schema | None,
    force: bool,
    where: Path,
    written: Callable[[], Iterable[pa.RecordBatch]],
) -> pa.Schema:
    """``schema`` with the dataset's fingerprint and the run seed added to its metadata; when resuming (``recorded``:
    the schema the partial output recorded, ``written`` its rows), its columns combined with the written rows'
    (:func:`~batchgen.job.output_columns.columns_for_resume`) and its settings checked against ``recorded``
    (:func:`check_same_job`).

    The run seed is ``seed``, else the recorded one (so that resumed rows get the seeds the first run gave them),
    else a random one.

    Raises:
        BatchgenError: the dataset cannot be read, or (when resuming) the columns do not combine, or
            :func:`check_same_job`'s errors.
    """
    recorded_seed = (recorded.metadata or {}).get(RUN_SEED_KEY.encode()) if recorded is not None else None
    if seed is None and recorded_seed is not None:
        seed = int(recorded_seed.decode())
    metadata = {
        **schema_metadata(schema),
        DATASET_KEY: fingerprint_dataset(dataset).to_json(),
        RUN_SEED_KEY: str(seed if seed is not None else secrets.randbits(63)),
    }
    schema = schema.with_metadata(metadata)
    if recorded is not None:
        combined = columns_for_resume(where, recorded, schema, written)
        check_same_job(where, recorded, schema, force)
        schema = combined
    return schema


def check_same_job(where: Path, recorded: pa.Schema, now: pa.Schema, force: bool) -> None:
    """Refuse to resume when this run would not produce what the interrupted one did, unless ``force``.

    Raises:
        BatchgenError: one line naming every difference in model, dtype, logprobs mode, kernel switches, sampling
            defaults, output-changing engine options (seed, context length) and the dataset.
    """
    differences = job_differences(schema_metadata(recorded), schema_metadata(now))
    if differences and not force:
        raise BatchgenError(
            f"{where}: cannot resume: this run differs from the one that wrote it: {'; '.join(differences)} "
            "(pass --resume-force to resume anyway, or --overwrite to start over)"
        )
    if differences:  # forced: the finished file will mix rows of both settings, so say which
        old_n, new_n = (_default_n(schema_metadata(schema)) for schema in (recorded, now))
        # A row is done when it has all of its n samples (DoneRows.is_done): rows that set no n of their own have
        # the old default's count, so they run again; rows that set one keep their samples.
        again = f" (rows that take the default n are generated again with n {new_n})" if old_n != new_n else ""
        print(f"batchgen: warning: {where}: resuming despite: {'; '.join(differences)}{again}", file=sys.stderr)


def resume_command(dataset: Path, out: Path) -> str:
    """The command that resumes this run: the command line as typed, without ``--overwrite``/``--resume-force``,
    with ``--resume`` (which replaces a ``--config`` file's ``overwrite``); a generic form when the process was not
    started from the command line."""
    argv = sys.argv
    if len(argv) >= 2 and argv[1] == "run":
        program = "python -m batchgen" if Path(argv[0]).name == "__main__.py" else "batchgen"
        args = [a for a in argv[1:] if a not in ("--overwrite", "--resume-force")]
        if "--resume" not in args:
            args.append("--resume")
        return f"{program} {shlex.join(args)}"
    return f"batchgen run {shlex.quote(str(dataset))} --out {shlex.quote(str(out))} <the same options> --resume"


def _default_n(metadata: dict[str, str]) -> int:
    """The run's default ``n`` as its output metadata records it (1 where it records no sampling defaults)."""
    with contextlib.suppress(ValueError, AttributeError):
        return int(json.loads(metadata.get("batchgen.sampling_defaults", "{}")).get("n", 1))
    return 1


def report_damage(directory: Path, state: PartialState | None) -> None:
    """Warn about the damaged files a resumed run drops (one line each)."""
    if state is None:
        return
    if state.manifest_damaged:
        print(f"batchgen: warning: {directory}/manifest.json is damaged; rebuilt from the part files", file=sys.stderr)
    for path in state.damaged:
        print(f"batchgen: warning: {path}: torn or damaged write, dropped; its rows run again", file=sys.stderr)
