"""The checks of a run's sampling defaults that ``batchgen run`` and the Python API share."""

from __future__ import annotations

import sys
from typing import get_type_hints

from batchgen.api.options import declared_options, type_problem
from batchgen.errors import BatchgenError, FieldError, shown_value
from batchgen.loop.engine import EngineFacts
from batchgen.sampling.sampling_params import SamplingParams


def check_sampling_defaults(defaults: SamplingParams, facts: EngineFacts | None) -> None:
    """Validate the sampling defaults: against the engine's vocabulary and its ``max_running_requests`` (all samples
    of a row decode together), as ``facts`` gives them, or, before the engine is loaded (``None``), the checks that
    need no model.

    Raises:
        BatchgenError: naming the option by its flag (``--temperature``), as the command line shows it.
    """
    _check_types(defaults)
    try:
        defaults.validate(facts.vocab_size if facts is not None else sys.maxsize)
    except FieldError as e:
        raise BatchgenError(f"--{e.field.replace('_', '-')}: {e.message}") from None
    if facts is not None and defaults.n > facts.max_running_requests:
        raise BatchgenError(f"--n {defaults.n} exceeds --max-running-requests {facts.max_running_requests}")


def _check_types(defaults: SamplingParams) -> None:
    """Refuse a sampling default of the wrong type, which only the Python API can give (a row's fields are checked
    as it is read, the flags by Typer): ``max_new_tokens="ten"`` would otherwise fail deep in a check.

    Raises:
        BatchgenError: ``--max-new-tokens: must be an integer, got "ten"``.
    """
    hints = get_type_hints(SamplingParams)
    for field in declared_options(SamplingParams):
        value = getattr(defaults, field.name)
        problem = type_problem(value, hints[field.name])
        if problem is not None:
            shown = shown_value(list(value) if isinstance(value, tuple) else value)
            raise BatchgenError(f"--{field.name.replace('_', '-')}: must be {problem}, got {shown}")
