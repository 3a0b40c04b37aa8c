"""The checks of a run's options that ``batchgen run``, ``batchgen status`` and the Python API share."""

from __future__ import annotations

from batchgen.errors import BatchgenError, FieldError
from batchgen.io.input_options import InputOptions
from batchgen.job.options import JobOptions
from batchgen.loop.engine import EngineFacts
from batchgen.loop.options import EngineOptions
from batchgen.sampling.grammar import constraint_grammar
from batchgen.sampling.sampling_params import SamplingParams


def check_run_options(
    options: EngineOptions, defaults: SamplingParams, job_options: JobOptions, input_options: InputOptions
) -> None:
    """Every rule of a run's options that needs no model and no file, in the order the command line names them.

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
    """Validate the sampling defaults: against the engine's vocabulary and its ``max_running_requests`` (all samples
    of a row decode together), as ``facts`` gives them, and together with the sampling defaults its model's
    generation_config.json gave (:meth:`SamplingParams.with_model_defaults`); or, before the engine is loaded
    (``None``), the checks that need no model.

    Their types were checked where they were given (the flags by Typer, the Python API's keywords by
    :func:`batchgen.api.options.options_of`).

    Raises:
        BatchgenError: naming the option by its flag (``--temperature``), as the command line shows it.
    """
    try:
        defaults.validate(facts.vocab_size if facts is not None else None)
    except FieldError as e:
        raise BatchgenError(f"--{e.field.replace('_', '-')}: {e.message}") from None
    if facts is not None and facts.sampling_defaults:
        try:
            defaults.with_model_defaults(facts.sampling_defaults).validate(facts.vocab_size)
        except FieldError as e:
            taken = ", ".join(f"{name} {value}" for name, value in facts.sampling_defaults.items())
            raise BatchgenError(
                f"--{e.field.replace('_', '-')}: {e.message}, with the defaults of the model's generation_config.json "
                f"({taken}; --generation-config none leaves them aside)"
            ) from None
    if facts is not None and defaults.n > facts.max_running_requests:
        raise BatchgenError(f"--n {defaults.n} exceeds --max-running-requests {facts.max_running_requests}")
