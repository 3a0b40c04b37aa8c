"""The checks of a run's sampling defaults that ``batchgen run`` and the Python API share."""

from __future__ import annotations

import sys

from batchgen.errors import BatchgenError, FieldError
from batchgen.loop.engine import EngineFacts
from batchgen.sampling.sampling_params import SamplingParams


def check_sampling_defaults(defaults: SamplingParams, facts: EngineFacts | None) -> None:
    """Validate the sampling defaults: against the engine's vocabulary and its ``max_running_requests`` (all samples
    of a row decode together), as ``facts`` gives them, or, before the engine is loaded (``None``), the checks that
    need no model.

    Their types were checked where they were given (the flags by Typer, the Python API's keywords by
    :func:`batchgen.api.options.options_of`).

    Raises:
        BatchgenError: naming the option by its flag (``--temperature``), as the command line shows it.
    """
    try:
        defaults.validate(facts.vocab_size if facts is not None else sys.maxsize)
    except FieldError as e:
        raise BatchgenError(f"--{e.field.replace('_', '-')}: {e.message}") from None
    if facts is not None and defaults.n > facts.max_running_requests:
        raise BatchgenError(f"--n {defaults.n} exceeds --max-running-requests {facts.max_running_requests}")
