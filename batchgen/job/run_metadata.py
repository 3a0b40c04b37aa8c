"""What a run records of itself in its output's metadata, what differs between two runs' records (what ``--resume``
compares: :mod:`batchgen.job.resume`), and the check that a finished output which ``--resume`` leaves as it is was
made with this run's settings."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from batchgen import __version__
from batchgen.environment import kernel_switches
from batchgen.errors import BatchgenError
from batchgen.io.fingerprint import DatasetFingerprint, fingerprint_dataset
from batchgen.io.finished_output import recorded_settings
from batchgen.io.input_options import INPUT_OPTIONS_KEY, InputOptions, apply_escapes
from batchgen.loop.engine import EngineFacts, dtype_name
from batchgen.loop.generation_config import sampling_defaults
from batchgen.loop.options import EngineOptions, pick_device
from batchgen.models.fingerprint import fingerprint_differences, model_fingerprint
from batchgen.sampling.sampling_params import MODEL_SAMPLING_FIELDS, SamplingParams

# Metadata keys a resumed run adds to ``RunJob.metadata``: the dataset's fingerprint and the run seed.
DATASET_KEY = "batchgen.dataset"
RUN_SEED_KEY = "batchgen.run_seed"
# Engine options that change what a row's output is; the others (batch sizes, memory) only change speed.
_OUTPUT_ENGINE_OPTIONS = ("seed", "context_length")
# The sampling defaults a generation_config.json gave the run (``--generation-config``), by field.
MODEL_SAMPLING_KEY = "batchgen.model_sampling_defaults"
# The fingerprint of the model folder's files (batchgen.models.fingerprint); none for random: models.
MODEL_FILES_KEY = "batchgen.model_files"
# Entries the loaded engine records: before the model is loaded, the recorded ones stand in for what only the model
# decides (its directory, a resolved ``--dtype auto``, the default of ``--deterministic``, the context length that
# ``--context-length`` defaults to); the sampling defaults of its generation_config.json are read again.
_MODEL_FACTS = (
    "batchgen.model_dir",
    "batchgen.dtype",
    "batchgen.kernel_switches",
    "batchgen.deterministic",
    "batchgen.model_context_length",
    MODEL_SAMPLING_KEY,
    # The most tokens a row holds (prompt and output): the context length, or a KV pool smaller than it (engine.py).
    "batchgen.context_length",
    MODEL_FILES_KEY,
)


def run_metadata(
    options: EngineOptions, defaults: SamplingParams, input_options: InputOptions, facts: EngineFacts
) -> dict[str, str]:
    """The settings a run records in its output's schema metadata (strings; JSON objects for option sets)."""
    model_facts = {
        "batchgen.model_dir": str(facts.model_dir),
        "batchgen.dtype": dtype_name(facts.dtype),
        "batchgen.kernel_switches": json.dumps(facts.kernel_switches),
        "batchgen.deterministic": str(facts.deterministic).lower(),
        "batchgen.model_context_length": str(facts.model_context_len),
        MODEL_SAMPLING_KEY: json.dumps(facts.sampling_defaults),
        "batchgen.context_length": str(facts.context_len),
        **({MODEL_FILES_KEY: model_fingerprint(facts.model_dir)} if facts.model_dir is not None else {}),
    }
    return {"batchgen.version": __version__} | _settings(options, defaults, input_options, model_facts)


def settings_differences(
    dataset: Path,
    recorded: dict[str, str],
    options: EngineOptions,
    defaults: SamplingParams,
    input_options: InputOptions,
) -> list[str]:
    """How the settings of a run with ``options``, ``defaults`` and ``input_options`` differ from those an output
    ``recorded`` (model, dtype, seed, sampling defaults...: :func:`job_differences`), as ``what old → new``
    phrases. Compared without loading the model: a ``--dtype`` or ``--deterministic`` left to the model is taken to
    be the recorded one; the dataset is not compared (its rows are checked by id and digest)."""
    model_facts = {key: recorded[key] for key in _MODEL_FACTS if key in recorded}
    # The environment's, as a run on the device --device picks records them.
    device = pick_device(options.device).type
    model_facts["batchgen.kernel_switches"] = json.dumps(kernel_switches().as_run_on(device).as_metadata(device))
    if options.dtype != "auto":
        model_facts["batchgen.dtype"] = options.dtype
    if options.deterministic is not None:
        model_facts["batchgen.deterministic"] = str(options.deterministic).lower()
    # The model's own folder where --model names one, else the one the output records (a built-in name's, say).
    named, recorded_dir = Path(options.model), Path(recorded.get("batchgen.model_dir", "None"))
    model_dir = next((path for path in (named, recorded_dir) if path.is_dir()), None)  # random:'s "None" is none
    if model_dir is not None or options.generation_config != "auto":  # else the recorded values stand in
        model_facts[MODEL_SAMPLING_KEY] = json.dumps(sampling_defaults(options.generation_config, model_dir)[0])
    model_facts |= {MODEL_FILES_KEY: model_fingerprint(model_dir)} if model_dir is not None else {}
    if options.max_total_tokens is not None and "batchgen.model_context_length" in recorded:
        # The pool --max-total-tokens sizes caps what a row holds (engine.py), which needs no model to tell (found
        # by a helper: a finished output took a smaller pool as "nothing to do", a partial one refused it).
        context = options.context_length or int(recorded["batchgen.model_context_length"])
        model_facts["batchgen.context_length"] = str(min(context, options.max_total_tokens))
    same_dataset = {DATASET_KEY: fingerprint_dataset(dataset).to_json()}
    now = _settings(options, defaults, input_options, model_facts)
    return job_differences(recorded | same_dataset, now | same_dataset)


def check_finished_settings(
    dataset: Path,
    out: Path,
    options: EngineOptions,
    defaults: SamplingParams,
    input_options: InputOptions,
    force: bool,
) -> None:
    """Before ``--resume`` leaves the complete output ``out`` as it is: refuse when this run's settings differ from
    those of the run that wrote it (:func:`settings_differences`), since the user asked for rows this output does not
    hold; with ``force``, warn and keep it. JSON Lines outputs record no settings: they pass, with a warning that they
    cannot be checked.

    Raises:
        BatchgenError: ``out`` cannot be read, or settings differ (one line naming each), unless ``force``.
    """
    recorded = recorded_settings(out)
    if recorded is None:
        warning = (
            f"batchgen: warning: {out} is JSON Lines, which records nothing of the run that wrote it: --resume cannot "
            "check its settings against this run's, nor its error rows against the dataset (an .arrow or .parquet "
            "output can be checked); it is left as it is"
        )
        print(warning, file=sys.stderr)
        return
    differences = settings_differences(dataset, recorded, options, defaults, input_options)
    if not differences:
        return
    if not force:
        raise BatchgenError(
            f"{out} is complete, but this run differs from the one that wrote it: {'; '.join(differences)}; "
            "--resume keeps a finished output as it is: pass --overwrite to run the dataset again with these settings, "
            "or --resume-force to keep it"
        )
    print(f"batchgen: warning: {out} was written with other settings ({'; '.join(differences)}); --resume-force "
          "keeps it as it is", file=sys.stderr)  # fmt: skip


def _settings(
    options: EngineOptions, defaults: SamplingParams, input_options: InputOptions, model_facts: dict[str, str]
) -> dict[str, str]:
    """The recorded settings: the options' JSON with ``model_facts`` (the entries of :data:`_MODEL_FACTS`), in the
    order outputs have always recorded them."""
    return {
        "batchgen.model": options.model,
        **{key: model_facts[key] for key in _MODEL_FACTS[:3] if key in model_facts},
        "batchgen.logprobs_mode": options.logprobs_mode,
        **{key: model_facts[key] for key in _MODEL_FACTS[3:] if key in model_facts},
        "batchgen.sampling_defaults": json.dumps(_rows_defaults(defaults, model_facts)),
        "batchgen.engine_options": json.dumps(asdict(options)),
        INPUT_OPTIONS_KEY: json.dumps(asdict(input_options)),
    }


def _rows_defaults(defaults: SamplingParams, model_facts: dict[str, str]) -> dict[str, object]:
    """What the rows default to: ``defaults`` with the sampling defaults ``model_facts`` record for those no option
    set (:meth:`SamplingParams.with_model_defaults`; none recorded by a batchgen before them), as a JSON object."""
    resolved = defaults.with_model_defaults(json.loads(model_facts.get(MODEL_SAMPLING_KEY, "{}")))
    return {name: value for name, value in asdict(resolved).items() if name != "left_to_model"}


def job_differences(recorded: dict[str, str], now: dict[str, str]) -> list[str]:
    """What differs between two runs' output metadata, as ``what old → new`` phrases; empty when nothing does."""
    differences = []
    for key, label in (("model", "model"), ("dtype", "dtype"), ("logprobs_mode", "logprobs mode")):
        old, new = recorded.get(f"batchgen.{key}"), now.get(f"batchgen.{key}")
        if old != new:
            differences.append(f"{label} {old!r} → {new!r}")
    if "batchgen.kernel_switches" in recorded:  # an output of a batchgen that did not record them: not compared
        differences += changed_fields("batchgen.kernel_switches", recorded, now, None)
    if recorded.get("batchgen.model") == now.get("batchgen.model"):  # another model is said once, above
        differences += fingerprint_differences(recorded.get(MODEL_FILES_KEY), now.get(MODEL_FILES_KEY))
    old_mode, new_mode = recorded.get("batchgen.deterministic"), now.get("batchgen.deterministic")
    if old_mode is not None and old_mode != new_mode:  # not recorded before batchgen had the mode: not compared
        flag = "--deterministic" if old_mode == "true" else "--no-deterministic"
        differences.append(f"deterministic {old_mode} → {new_mode} ({flag} resumes in the written rows' mode)")
    differences += changed_fields("batchgen.sampling_defaults", _sampling_defaults_in_full(recorded, now), now, None)
    differences += _file_differences(recorded, now)
    engine_then, engine_now = _engine_options_as_run(recorded, now)
    options_changed = changed_fields("batchgen.engine_options", engine_then, engine_now, _OUTPUT_ENGINE_OPTIONS)
    differences += options_changed
    old_len, new_len = recorded.get("batchgen.context_length"), now.get("batchgen.context_length")
    if old_len and new_len and old_len != new_len and not any(p.startswith("context_length") for p in options_changed):
        # A helper's trial: a resume with a smaller --max-total-tokens cut rows at the smaller pool, accepted.
        pool = "the KV pool, which --max-total-tokens or --mem-fraction sizes, holds fewer tokens than the context"
        models = [d.get("batchgen.model_context_length") for d in (recorded, now)]
        if models[0] != models[1]:  # another model's context (found by a helper: the pool was blamed)
            pool = f"the model's context length {models[0]} → {models[1]}"
        differences.append(f"tokens a row may hold {old_len} → {new_len} ({pool})")
    # An output of a batchgen without column options reads as one made with none.
    differences += changed_fields(INPUT_OPTIONS_KEY, _escaped(recorded), _escaped(now), None)
    try:
        old_dataset = DatasetFingerprint.from_json(recorded.get(DATASET_KEY, ""))
    except ValueError:
        differences.append("dataset (no fingerprint recorded)")
    else:
        differences += old_dataset.differences(DatasetFingerprint.from_json(now[DATASET_KEY]))
    return differences


def _file_differences(recorded: dict[str, str], now: dict[str, str]) -> list[str]:
    """Where the rows' defaults differ in a field a generation_config.json may set and the file's values changed (an
    output of a batchgen that did not read them records none), that change, and the flags that give the rows the
    defaults they were written with (a flag wins over the file)."""
    old, new = recorded.get(MODEL_SAMPLING_KEY), now.get(MODEL_SAMPLING_KEY, "{}")
    key = "batchgen.sampling_defaults"
    try:
        written, asked = (json.loads(m.get(key, "{}")) for m in (_sampling_defaults_in_full(recorded, now), now))
    except json.JSONDecodeError:
        return []  # changed_fields says it is unreadable
    changed = [name for name in MODEL_SAMPLING_FIELDS if written.get(name) != asked.get(name)]
    if (old or "{}") == new or not changed:
        return []
    pins = " ".join(f"--{name.replace('_', '-')} {written[name]}" for name in changed)
    then = "none recorded (a batchgen that left them aside)" if old is None else old
    return [f"the model's generation_config.json defaults {then} → {new} ({pins} resumes as written)"]


def _engine_options_as_run(recorded: dict[str, str], now: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """``recorded`` and ``now`` with their engine options as the rows see them, so that options that give the rows the
    written ones compare equal:

    - an omitted ``--seed`` is the recorded one, which the run reuses (``output_schema``), and an unrecorded one (a
      run without ``--seed``, or resumed without it) is the run seed the rows were seeded from: a ``--seed`` equal to
      it is no change (found by a helper: a script pinning the recorded seed was refused), and another is shown
      against it (a new user read "seed not given → 2" of an output seeded with 1);
    - an omitted ``--context-length`` is the model's own, which it defaults to (the recorded
      ``batchgen.model_context_length``, or, for an output of a batchgen that did not record it, the loaded model's;
      found by a new user: an explicit ``--context-length 8192`` on a model of 8,192 positions was refused).
    """
    key = "batchgen.engine_options"
    own = recorded.get("batchgen.model_context_length") or now.get("batchgen.model_context_length")
    try:
        then, options = (json.loads(metadata.get(key, "{}")) for metadata in (recorded, now))
        if then.get("seed") is None and recorded.get(RUN_SEED_KEY) is not None:
            then["seed"] = int(recorded[RUN_SEED_KEY])
        if options.get("seed") is None:
            options["seed"] = then.get("seed")
        for given in (then, options):
            if own is not None and given.get("context_length") is None:  # neither says: compared as given
                given["context_length"] = int(own)
    except (json.JSONDecodeError, AttributeError, ValueError):
        return recorded, now  # unreadable: changed_fields says so
    return recorded | {key: json.dumps(then)}, now | {key: json.dumps(options)}


def _escaped(metadata: dict[str, str]) -> dict[str, str]:
    """``metadata`` with the recorded ``--prompt-template`` as it reads with its escapes applied: ``'\\n'`` typed on a
    command line and a newline from a config file are one template."""
    try:
        options = json.loads(metadata.get(INPUT_OPTIONS_KEY, "{}"))
        if isinstance(options.get("prompt_template"), str):
            options["prompt_template"] = apply_escapes(options["prompt_template"])
    except (json.JSONDecodeError, AttributeError):
        return metadata
    return metadata | {INPUT_OPTIONS_KEY: json.dumps(options)}


def _sampling_defaults_in_full(recorded: dict[str, str], now: dict[str, str]) -> dict[str, str]:
    """``recorded`` with its sampling defaults completed by the fields that ``now`` records and a batchgen that wrote
    them did not have yet (``include_stop_str_in_output``), at their defaults: a run that asks for none of them
    resumes such an output."""
    try:
        old, new = (json.loads(m.get("batchgen.sampling_defaults", "{}")) for m in (recorded, now))
    except json.JSONDecodeError:
        return recorded  # changed_fields says it is unreadable
    defaults = asdict(SamplingParams())
    added = {name: defaults[name] for name in new if name not in old and name in defaults}
    return {**recorded, "batchgen.sampling_defaults": json.dumps(added | old)}


def changed_fields(key: str, recorded: dict[str, str], now: dict[str, str], only: tuple[str, ...] | None) -> list[str]:
    """``name old → new`` for each field of the JSON object under ``key`` that differs (only those in ``only``)."""
    try:
        old, new = json.loads(recorded.get(key, "{}")), json.loads(now.get(key, "{}"))
    except json.JSONDecodeError:
        return [f"{key} (unreadable)"]
    names = only if only is not None else sorted(set(old) | set(new))
    return [
        f"{name} {_shown(old.get(name))} → {_shown(new.get(name))}" for name in names if old.get(name) != new.get(name)
    ]


def _shown(value: object) -> str:
    """A recorded option value as a user reads it: ``None`` is an option that was not given."""
    return "not given" if value is None else repr(value)
