"""What a run records of itself in its output's metadata (the settings ``--resume`` compares:
:mod:`batchgen.job.resume`), and the check that a finished output which ``--resume`` leaves as it is was made with
this run's settings."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa

from batchgen import __version__
from batchgen.errors import BatchgenError
from batchgen.io.fingerprint import fingerprint_dataset
from batchgen.io.input_options import INPUT_OPTIONS_KEY, InputOptions
from batchgen.io.reopen import finished_batches
from batchgen.job.resume import DATASET_KEY, job_differences
from batchgen.loop.engine import EngineFacts, dtype_name
from batchgen.loop.options import EngineOptions
from batchgen.sampling.sampling_params import SamplingParams

# Entries the loaded model decides (a resolved ``--dtype auto``, the default of ``--deterministic``, the kernel
# switches the device takes): before the model is loaded, the recorded ones stand in for them.
_MODEL_FACTS = ("batchgen.model_dir", "batchgen.dtype", "batchgen.kernel_switches", "batchgen.deterministic")


def run_metadata(
    options: EngineOptions, defaults: SamplingParams, input_options: InputOptions, facts: EngineFacts
) -> dict[str, str]:
    """The settings a run records in its output's schema metadata (strings; JSON objects for option sets)."""
    model_facts = {
        "batchgen.model_dir": str(facts.model_dir),
        "batchgen.dtype": dtype_name(facts.dtype),
        "batchgen.kernel_switches": json.dumps(facts.kernel_switches),
        "batchgen.deterministic": str(facts.deterministic).lower(),
    }
    return {"batchgen.version": __version__} | _settings(options, defaults, input_options, model_facts)


def check_finished_settings(
    dataset: Path,
    out: Path,
    options: EngineOptions,
    defaults: SamplingParams,
    input_options: InputOptions,
    force: bool,
) -> None:
    """Before ``--resume`` leaves the complete output ``out`` as it is: refuse when this run's settings differ from
    those of the run that wrote it (model, dtype, seed, sampling defaults...: :func:`job_differences`), since the user
    asked for rows this output does not hold; with ``force``, warn and keep it. Compared without loading the model:
    a ``--dtype`` or ``--deterministic`` this run leaves to the model is taken to be the recorded one. JSON Lines
    outputs record no settings and pass.

    Raises:
        BatchgenError: ``out`` cannot be read, or settings differ (one line naming each), unless ``force``.
    """
    if out.suffix.lower() == ".jsonl":
        return
    try:
        schema, _ = finished_batches(out, ["id"])
    except (OSError, pa.ArrowException) as e:
        raise BatchgenError(f"{out}: cannot read results ({e})") from None
    recorded = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
    model_facts = {key: recorded[key] for key in _MODEL_FACTS if key in recorded}
    if options.dtype != "auto":
        model_facts["batchgen.dtype"] = options.dtype
    if options.deterministic is not None:
        model_facts["batchgen.deterministic"] = str(options.deterministic).lower()
    # The rows were checked against the dataset as it is now (check_nothing_left): it is not compared again.
    same_dataset = {DATASET_KEY: fingerprint_dataset(dataset).to_json()}
    now = _settings(options, defaults, input_options, model_facts)
    differences = job_differences(recorded | same_dataset, now | same_dataset)
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
        "batchgen.sampling_defaults": json.dumps(asdict(defaults)),
        "batchgen.engine_options": json.dumps(asdict(options)),
        INPUT_OPTIONS_KEY: json.dumps(asdict(input_options)),
    }
