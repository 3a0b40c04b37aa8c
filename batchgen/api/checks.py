"""The checks of a run's options that ``batchgen run``, ``batchgen status`` and the Python API share."""

from __future__ import annotations

from dataclasses import replace

from batchgen.errors import BatchgenError, FieldError
from batchgen.io.input_options import InputOptions
from batchgen.job.options import JobOptions
from batchgen.loop.engine import EngineFacts
from batchgen.loop.options import EngineOptions
from batchgen.sampling.constraints import constraint_grammar
from batchgen.sampling.sampling_params import SamplingParams


def check_run_options(
    options: EngineOptions, defaults: SamplingParams, job_options: JobOptions, input_options: InputOptions
) -> None:
    """Every rule of a run's options that needs no model and no input or output file, in the order the command line
    names them: the run's constraint compiled to a grammar (no tokenizer needed), a ``--generation-config`` folder
    holding its file.

    Raises:
        BatchgenError: one line naming the first bad flag and its value.
    """
    job_options.validate()
    input_options.validate()
    options.validate(here=not job_options.ray)  # before the output's checks: a mistyped flag is named first
    check_sampling_defaults(defaults, None)
    if defaults.constraint is not None:  # compiled again with the tokenizer: here before the model loads
        name, text = defaults.constraint
        try:
            constraint_grammar(name, text)
        except FieldError as e:
            raise BatchgenError(f"--{name.replace('_', '-')}: {e.message}") from None


def check_sampling_defaults(defaults: SamplingParams, facts: EngineFacts | None) -> None:
    """Validate the sampling defaults: before the engine is loaded (``facts`` ``None``), the checks that need no
    model, a ``max_new_tokens`` left to the model's generation_config.json taken to be at least
    ``min_new_tokens``; with ``facts``, against the engine's vocabulary, together with the sampling defaults that file
    gave
    (:meth:`SamplingParams.with_model_defaults`).

    Their types were checked where they were given (the flags by Typer, the Python API's keywords by
    :func:`batchgen.api.options.options_of`).

    Raises:
        BatchgenError: naming the option by its flag (``--temperature``), as the command line shows it, and the
            file whose defaults it breaks a rule with.
    """
    model = facts.sampling_defaults if facts is not None else None  # None: not read yet
    given = defaults.with_model_defaults({})  # batchgen's own defaults where no option gives one
    if "max_new_tokens" in defaults.left_to_model and (model is None or "max_new_tokens" in model):
        # The file may give it, or does: min_new_tokens is checked against the file's below.
        given = replace(given, max_new_tokens=max(given.max_new_tokens, given.min_new_tokens))
    _validate(given, facts.vocab_size if facts is not None else None, "")
    if facts is None:
        return
    if facts.sampling_defaults_file is not None:  # what fails now, fails with the file's values
        taken = ", ".join(f"{name} {value}" for name, value in facts.sampling_defaults.items())
        aside = "--generation-config none leaves them aside"
        note = f", with the defaults of {facts.sampling_defaults_file} ({taken}; {aside})"
        _validate(defaults.with_model_defaults(facts.sampling_defaults), facts.vocab_size, note)


def _validate(defaults: SamplingParams, vocab_size: int | None, note: str) -> None:
    """:meth:`SamplingParams.validate`, its error named by the option's flag and followed by ``note``."""
    try:
        defaults.validate(vocab_size)
    except FieldError as e:
        raise BatchgenError(f"--{e.field.replace('_', '-')}: {e.message}{note}") from None
