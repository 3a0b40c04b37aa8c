"""``batchgen status DATASET OUT``: how far a run has got, from its partial output or its finished file.

Rows done are input rows the output accounts for: a row with its samples (counted once, whatever its ``n``), or
an error row (``--on-error skip``). When the dataset is the file the output records (its fingerprint unchanged),
the output's rows are counted; a finished output, or one made from another version of the dataset, is matched to
the dataset's rows by id. Nothing is changed on disk, so it is safe next to a running job.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from batchgen.errors import BatchgenError, counted
from batchgen.io.fingerprint import DatasetFingerprint, fingerprint_dataset
from batchgen.io.finished_output import finished_rows, records_run
from batchgen.io.input_digests import INPUT_DIGESTS_KEY, InputId, compare_each, compare_rows, input_ids
from batchgen.io.input_options import InputOptions, recorded_input_options
from batchgen.io.output_format import check_output_format
from batchgen.io.output_lock import held_by_a_run
from batchgen.io.partial_output import PartialOutput, partial_dir
from batchgen.io.reader import count_input_rows
from batchgen.job.changed_rows import check_finished_rows
from batchgen.job.part_settings import foreign_parts
from batchgen.job.run_metadata import DATASET_KEY, settings_differences
from batchgen.loop.options import EngineOptions
from batchgen.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class OutputStatus:
    """How far the run from ``dataset`` to ``out`` has got (see :func:`read_output_status`)."""

    dataset: Path
    out: Path
    state: str
    done: int
    total: int
    errored: int
    notes: list[str]
    # What differs in the dataset since the run started (size, modification time, ...); empty when unchanged.
    dataset_changes: list[str]
    # The output's rows whose input row changed or left the dataset since (--resume refuses them unless
    # --resume-force); every row where the output records no digests of its input rows.
    stale: int = 0
    # The output's error rows when the dataset changed: their rows may be fixed, so --resume (with --resume-force
    # too) reads the dataset again to check them.
    recheck: int = 0
    # How the run's settings (a --config's) differ from those the output records; empty when the same or not compared.
    other_settings: tuple[str, ...] = ()
    force: bool = False  # the run's --resume-force keeps what is there, whatever changed

    @property
    def remaining(self) -> int:
        return max(self.total - self.done, 0)

    @property
    def complete(self) -> bool:
        """Whether ``out`` is a finished output that holds a row for every row of the dataset as it is now."""
        kept = self.force or not (self.stale or self.other_settings)
        return self.state == "complete" and not self.remaining and not self.recheck and kept

    def lines(self) -> list[str]:
        """``OUT: STATE: D of T rows done, R remaining, E errored``, then one line per note."""
        # A finished output file that lacks rows is not "complete", though nothing is in progress; one that --resume
        # refuses says why first, whether or not it lacks rows (a helper: "--resume adds them", then refused).
        state = self.state
        if self.state == "complete":
            if (self.recheck and not self.remaining) or (self.stale and not self.force):
                state = "finished from rows changed since"
            elif self.other_settings and not self.force:
                state = "finished with other settings"
            elif self.remaining:
                state = "finished with rows missing"
        line = f"{self.out}: {state}: {self.done} of {self.total} rows done, {self.remaining} remaining, "
        line += f"{self.errored} errored"
        if state == "finished with rows missing":
            # A new user's trial: the hint named --resume for a .jsonl output, which cannot be resumed.
            how = (
                "a .jsonl output cannot be resumed: once they are fixed, --overwrite runs the dataset again"
                if not records_run(self.out)
                else "--resume adds them to an .arrow or .parquet output once they are fixed"
            )
            line += f" (bad rows that --on-error fail left out, or rows added since; {how})"
        notes = list(self.notes)
        if self.dataset_changes:
            notes.append(
                f"{self.out} was made from another version of {self.dataset}, or from another file "
                f"({'; '.join(self.dataset_changes)}): its rows are matched to {self.dataset}'s by id"
            )
        return [line, *(f"{self.out}: note: {note}" for note in notes)]


def read_output_status(
    dataset: Path,
    out: Path,
    options: InputOptions | None = None,
    settings: tuple[EngineOptions, SamplingParams] | None = None,
    force: bool = False,
    check_rows: bool = True,
) -> OutputStatus:
    """Rows done, remaining and errored of the run from ``dataset`` to ``out``, with notes on a changed dataset
    and damaged part files; the dataset's ids read with the column ``options`` (``None``: those ``out`` records).
    With a run's ``settings`` (engine options and sampling defaults, with ``options``: a ``--config``'s), the
    output is compared with them as ``--resume`` compares it (:func:`settings_differences`); with ``force``
    (``--resume-force``) what differs is noted but counts as kept, as ``--resume-force`` keeps it. Without
    ``check_rows``, a finished output's rows are not checked against a changed dataset (``stale`` and ``recheck``
    stay 0: the caller checks them itself, as ``--resume`` does).

    Raises:
        BatchgenError: the dataset or the output cannot be read, or ``out`` is no output format batchgen writes (as
            a run refuses it; found by a helper: "not started").
    """
    check_output_format(out)
    total = count_input_rows(dataset)
    notes = []
    metadata: dict[bytes, bytes] = {}
    sample_ids: Iterable[str] = ()
    error_ids: Counter[str] = Counter()
    digests: str | dict[str, bytes] | None = None  # of the input rows (a finished output's; a partial one's by id)
    if out.exists():
        state = "complete"
        rows = finished_rows(out)
        sample_ids, error_ids, metadata = rows.samples, rows.errors, rows.metadata
        digests = metadata[INPUT_DIGESTS_KEY.encode()].decode() if INPUT_DIGESTS_KEY.encode() in metadata else None
    elif partial_dir(out).is_dir():
        partial = PartialOutput(out).inspect()
        sample_ids = partial.done.samples
        for (rid, _), count in partial.done.errors.items():  # several error rows of an id differ by message
            error_ids[rid] += count
        # Found by a helper: --resume refuses a partial output a run holds, which status did not say; and one that
        # no run holds was called "in progress" after a Ctrl-C. Only this machine's runs are seen.
        running = held_by_a_run(partial_dir(out))
        parts = f"{counted(len(partial.parts), 'part file')} in {partial_dir(out)}"
        unheld = f"stopped ({parts}; no run on this machine holds it)"
        state = {True: f"in progress ({parts})", False: unheld, None: f"partial ({parts})"}[running]
        if running:
            notes.append("a run is writing it now: --resume refuses it until that run ends")
        metadata = (partial.schema.metadata or {}) if partial.schema is not None else {}
        digests = partial.input_digests
        if partial.damaged:
            notes.append(
                f"{counted(len(partial.damaged), 'torn or damaged part file')} (dropped on resume, their rows rerun)"
            )
        if partial.manifest_damaged:
            notes.append("the manifest is damaged (rebuilt from the part files on resume)")
        unlike = foreign_parts(partial, partial.schema) if partial.schema is not None else []
        if unlike:  # found by a review: counted as done, where --resume refuses them
            (first, differences), *_ = unlike
            notes.append(
                f"{counted(len(unlike), 'part file')} written with other settings than the partial output's "
                f"({first.name}: {'; '.join(differences)}): --resume refuses them unless --resume-force"
            )
    else:
        state = "not started"
    if state == "complete" and DATASET_KEY.encode() not in metadata:
        # JSON Lines has no schema to carry the run's metadata (found by a new user: a finished output of another
        # dataset looked like this one's, "complete" with rows remaining).
        why = "its metadata lacks it" if records_run(out) else "JSONL has no metadata"
        notes.append(f"{out} records no dataset fingerprint ({why}): it may come from another file")
    changes: list[str] = []
    if DATASET_KEY.encode() in metadata:
        recorded = DatasetFingerprint.from_json(metadata[DATASET_KEY.encode()].decode())
        changes = recorded.differences(fingerprint_dataset(dataset))
    if state == "complete" or changes:
        # By id, not by count: a row the output lacks can hide behind a row the dataset no longer has.
        # JSON Lines records no options: a run's --id-column is only known where status is given it (found by a
        # helper: every row of such a run looked foreign, with no word why).
        guessed = options is None and not metadata
        options = options if options is not None else recorded_input_options(metadata)
        done, errored, foreign = _matched(input_ids(dataset, options), set(sample_ids), error_ids)
        if foreign:
            verb = "has" if foreign == 1 else "have"
            # No row took samples (an unreadable line still takes its null error row: found by a helper).
            none_match = done == errored
            hint = " (a run that took its ids from a column: give status its --id-column too)"
            hint = hint if guessed and none_match else ""
            notes.append(f"{counted(foreign, 'row')} of {out} {verb} an id {dataset} lacks{hint}")
    else:  # the output's rows are this dataset's: counted without reading the dataset
        done, errored = len(set(sample_ids)) + error_ids.total(), error_ids.total()
    stale = recheck = 0
    if check_rows and changes:
        where = out if state == "complete" else partial_dir(out)
        if digests is None:
            # An older batchgen's output, or a run of more rows than digests are kept for: --resume cannot check
            # the rows, so it refuses the changed dataset unless --resume-force (found by a helper).
            stale = done
            notes.append(f"{where} records no digests of its input rows, so they cannot be checked: {_then(force)}")
        else:
            stale = _changed_rows(dataset, where, list(sample_ids), digests, options, force, notes)
            # Every error row, those of rows that left the dataset too (found by a helper): --resume reads the
            # dataset again for them, and leaves out the ones it no longer meets.
            if recheck := error_ids.total():
                notes.append(f"the dataset changed: --resume checks {where}'s {counted(recheck, 'error row')} again")
    other: list[str] = []
    if settings is not None and state != "not started":
        if not metadata:
            notes.append(f"{out} records no settings (JSON Lines): not compared with the run's")
        written = {k.decode(): v.decode() for k, v in metadata.items()}
        other = settings_differences(dataset, written, *settings, options or InputOptions()) if metadata else []
        if other:
            notes.append(f"{out} was made with other settings than the run's ({'; '.join(other)}): {_then(force)}")
    return OutputStatus(dataset, out, state, done, total, errored, notes, changes, stale, recheck, tuple(other), force)


def _then(force: bool) -> str:
    """What ``--resume`` does with an output it cannot take as it is: keeps it with ``force``, else refuses it."""
    return "--resume-force keeps it" if force else "--resume refuses it unless --resume-force"


def _changed_rows(
    dataset: Path,
    out: Path,
    sample_ids: list[str],
    digests: str | dict[str, bytes],
    options: InputOptions | None,
    force: bool,
    notes: list[str],
) -> int:
    """How many of ``sample_ids`` (rows of the output ``out``) were made from an input row that ``dataset`` no longer
    holds under their id, changed or gone (a finished output's ``digests``, their text: :func:`compare_rows`; a partial
    output's, by id: :func:`compare_each`), noted in ``notes`` with what ``--resume`` does with them (refuses them;
    keeps them with ``force``)."""
    try:
        if isinstance(digests, str):
            changed, gone, _ = compare_rows(dataset, sample_ids, digests, options)
        else:
            changed, gone = compare_each(dataset, sample_ids, digests, options)
    except ValueError:
        notes.append(f"{out}'s input digests are unreadable: its rows cannot be checked against {dataset}")
        return 0
    if stale := len(changed) + len(gone):
        them = "it" if stale == 1 else "them"
        then = f"--resume refuses {them}; --overwrite runs the dataset again"
        then = f"--resume-force keeps {them}" if force else then
        notes.append(f"{counted(stale, 'row')} of {out} changed in {dataset} or left it since it was made ({then})")
    return stale


def _matched(dataset_ids: Iterable[InputId], sample_ids: set[str], error_ids: Counter[str]) -> tuple[int, int, int]:
    """(rows done, of them errored, output rows matching no row): each dataset row, in order, takes its id's
    samples (once) or else one of its id's error rows (a duplicate id is an error row beside the real row); a row
    that claims no id (:func:`~batchgen.io.row_ids.claims_id`) only an error row."""
    done = errored = 0
    unmatched, errors = set(sample_ids), Counter(error_ids)
    for rid, claims, _ in dataset_ids:
        if claims and rid in unmatched:
            unmatched.discard(rid)
            done += 1
        elif errors[rid] > 0:
            errors[rid] -= 1
            done, errored = done + 1, errored + 1
    return done, errored, len(unmatched) + errors.total()


def check_nothing_left(dataset: Path, out: Path, force: bool, options: InputOptions | None = None) -> bool:
    """Before ``--resume`` calls the finished output ``out`` complete: whether it holds every row of ``dataset`` as the
    dataset is now, read with the column ``options`` of this run (``True``), or lacks rows (bad rows that
    ``--on-error fail`` left out, fixed since; rows added), which the run then adds (``False``). The rows it holds
    are checked one by one (:func:`check_finished_rows`); for an output that records no digests of its inputs (an
    older batchgen's) only the dataset file's fingerprint is, and ``force`` (``--resume-force``) takes it as it is.

    Raises:
        BatchgenError: a JSON Lines output lacks rows (it records nothing to resume from); rows changed; or (no
            digests) the dataset changed or rows are missing, unless ``force``.
    """
    status = read_output_status(dataset, out, options, check_rows=False)  # check_finished_rows checks them below
    if not status.remaining and not status.dataset_changes:
        return True
    if not records_run(out):  # no metadata, so no dataset changes either: rows are missing
        raise BatchgenError(
            f"{out}: a finished JSON Lines output records nothing of the run that made it (model, seed, inputs), so "
            "--resume cannot add the rows it lacks; pass --overwrite to run the whole dataset again (.arrow and "
            ".parquet outputs can be resumed)"
        )
    complete = check_finished_rows(dataset, out, force, options)
    if complete is not None:
        # A row whose id the output holds may still be missing: a duplicate id that --on-error fail left out.
        return complete and not status.remaining
    if force:
        if status.dataset_changes:
            changes = "; ".join(status.dataset_changes)
            warning = f"batchgen: warning: {dataset} changed since {out} was made ({changes}); --resume-force keeps it"
            print(warning, file=sys.stderr)
        return not status.remaining
    if status.remaining:
        raise BatchgenError(
            f"{out} holds {status.done} of the {status.total} rows of {dataset} and records no digests of its input "
            "rows (an older batchgen made it), so they cannot be checked: pass --resume-force to keep them and add the "
            "missing rows, or --overwrite to run the whole dataset again"
        )
    raise BatchgenError(
        f"{out} is a finished output made from {dataset} before it changed ({'; '.join(status.dataset_changes)});"
        " pass --resume-force to keep it as it is, or --overwrite to run the whole dataset again"
    )
