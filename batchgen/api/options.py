"""Every options class of ``batchgen run`` (:data:`OPTION_CLASSES`), and options given by their Python names
(``batchgen.run(..., max_new_tokens=64)``) sorted into them; the command line's flags derive from the same
declarations (:mod:`batchgen.cli.options`)."""

from __future__ import annotations

import difflib
import numbers
import os
from collections.abc import Collection, Mapping
from dataclasses import Field, fields
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

import torch

from batchgen.errors import BatchgenError, FieldError, shown_value
from batchgen.io.field_warnings import sampling_name_hint
from batchgen.io.input_options import InputOptions
from batchgen.io.passthrough import ADD_GENERATION_PROMPT_FIELD, CONTINUE_FINAL_MESSAGE_FIELD, TOOLS_FIELD
from batchgen.job.options import JobOptions
from batchgen.loop.options import EngineOptions
from batchgen.sampling.plain_values import python_value
from batchgen.sampling.row_fields import ROW_FIELD_KEYWORDS, SAMPLING_FIELD_ALIASES, switch_hint
from batchgen.sampling.sampling_params import MODEL_SAMPLING_FIELDS, SamplingParams

OPTION_CLASSES: tuple[type, ...] = (EngineOptions, SamplingParams, JobOptions, InputOptions)

T = TypeVar("T")


def declared_options(cls: type) -> list[Field[Any]]:
    """The fields of ``cls`` that are command-line options: those whose metadata has a ``help``."""
    return [f for f in fields(cls) if "help" in f.metadata]


def option_names(*classes: type) -> set[str]:
    """The Python names of the declared options of ``classes``."""
    return {f.name for cls in classes for f in declared_options(cls)}


# Fields of a messages row that vLLM's LLM.chat takes as arguments for the call: a batchgen row gives its own.
_ROW_ONLY = frozenset((TOOLS_FIELD, ADD_GENERATION_PROMPT_FIELD, CONTINUE_FINAL_MESSAGE_FIELD))


def check_option_names(
    given: Mapping[str, Any], classes: tuple[type, ...], caller: str, also: Collection[str] = ()
) -> None:
    """Refuse a keyword that is no declared option of ``classes`` (nor one of ``also``), as Python refuses an
    unknown keyword argument.

    Raises:
        TypeError: ``{caller}() got an unexpected keyword argument 'name'``, with ``(did you mean 'other'?)`` for
            a row field's alias (vLLM's ``max_tokens``) or a near spelling of a known option, or ``('other' is an
            option of generate() and stream())`` for an option (or another name of one) that ``caller`` does not
            take.
    """
    known = option_names(*classes) | set(also)
    unknown = next((name for name in given if name not in known), None)
    if unknown is None:
        return
    if unknown in _ROW_ONLY:  # vLLM's LLM.chat(tools=, continue_final_message=): each row gives its own
        raise TypeError(
            f"{caller}() got an unexpected keyword argument '{unknown}' (give it in each row, by its messages)"
        )
    # Another engine's name says more than a near spelling (HF's stop_strings is 'stop', not 'stop_token_ids'; its
    # do_sample is a temperature).
    field, note = name_meant(unknown)
    meant = field or unknown
    if meant in known:
        said: str | None = f"did you mean '{meant}'?"
    elif meant in ROW_FIELD_KEYWORDS:  # generate()'s and stream()'s, for every row; elsewhere a row's own
        where = (
            "a row field: give it in each row" if SamplingParams in classes else "an option of generate() and stream()"
        )
        said = f"'{meant}' is {where}"
    elif meant in option_names(*OPTION_CLASSES):  # Generator(max_new_tokens=...): generate's
        where = "Generator()" if meant in option_names(EngineOptions) else "generate() and stream()"
        if meant in option_names(JobOptions):
            where = "batchgen.run()"
        said = f"'{meant}' is an option of {where}"
        if meant == "seed" and SamplingParams in classes:  # vLLM's SamplingParams(seed=) seeds each request
            said += "; a row's own 'seed' seeds that row"
    else:
        near = near_name(unknown, known) if note is None else None
        said = note or (f"did you mean '{near}'?" if near else None)
    hint = f" ({said})" if said else ""
    raise TypeError(f"{caller}() got an unexpected keyword argument '{unknown}'{hint}")


# Other engines' names for batchgen's options (vLLM's LLM arguments and flags, SGLang's server arguments): named in
# hints, never taken, since a name that looks alike may mean another thing (vLLM's max_model_len is the context
# length, not max_total_tokens, the nearest spelling).
FOREIGN_OPTION_NAMES: dict[str, str] = {
    "max_model_len": "context_length",
    "max_num_seqs": "max_running_requests",
    "max_num_batched_tokens": "max_prefill_tokens",
    "gpu_memory_utilization": "mem_fraction",
    "mem_fraction_static": "mem_fraction",
    "enable_prefix_caching": "prefix_cache",
    "enforce_eager": "disable_cuda_graph",
    "enable_deterministic_inference": "deterministic",
    "model_path": "model",
    "random_seed": "seed",
    "sampling_defaults": "generation_config",
}


def option_meant(name: str) -> str | None:
    """The option that ``name`` stands for as a row field's alias (vLLM's ``max_tokens``) or another engine's name
    (:data:`FOREIGN_OPTION_NAMES`), or ``None``."""
    return SAMPLING_FIELD_ALIASES.get(name) or FOREIGN_OPTION_NAMES.get(name)


def name_meant(name: str) -> tuple[str | None, str | None]:
    """What ``name``, no option or field of batchgen's, stands for: ``(option, None)`` for a row field's alias or
    another engine's option name (:func:`option_meant`), else :func:`~batchgen.io.field_warnings.sampling_name_hint`'s
    ``(field, None)``, ``(None, note)`` or ``(None, None)``; one reading for Python keywords, flags and config keys."""
    meant = option_meant(name)
    return (meant, None) if meant is not None else sampling_name_hint(name)


def near_name(name: str, known: Collection[str]) -> str | None:
    """The option of ``known`` (Python names) that ``name`` was probably meant to be: the one a row field's alias
    (vLLM's ``max_tokens``) or another engine's option name (:data:`FOREIGN_OPTION_NAMES`) stands for, else a near
    spelling; ``None`` for none, and for such a name whose option is not among ``known`` (``max_tokens`` given to
    ``Generator``: the near spelling, ``max_total_tokens``, is another thing)."""
    meant = option_meant(name)
    if meant is not None:
        return meant if meant in known else None
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return close[0] if close else None


def options_of(cls: type[T], given: Mapping[str, Any], **fixed: Any) -> T:
    """An object of options class ``cls`` from the values ``given`` by Python name (those not declared by ``cls``
    are left out: they belong to another class) and ``fixed`` (set whether declared or not, e.g. ``model``). As
    ``--config`` takes them, a tuple option takes a list or tuple, or one value alone (``stop="\\n"``), and ``None``
    is the default of an option that takes no ``None``; numpy's values are the values they hold, a path or a
    ``torch.device`` is its text, and a number given for a float option is that float.

    Raises:
        BatchgenError: a value of the wrong type, named by its flag as the command line names a bad value
            (``--max-running-requests: must be an integer, got "4"``; a switch given anything but ``True`` or
            ``False``, or ``None`` where that means its default is decided later: ``--prefix-cache: must be True or
            False, got 0``), rather than a ``TypeError`` from deep inside the run.
    """
    hints = get_type_hints(cls)
    values = dict(fixed)
    for f in declared_options(cls):
        if f.name in fixed or f.name in given:
            value = fixed[f.name] if f.name in fixed else given[f.name]
            if value is None and type(None) not in get_args(hints[f.name]):
                values.pop(f.name, None)
            elif "parse" in f.metadata:  # an option that takes more than its type (prompt_logprobs: true)
                values[f.name] = _parsed(f, python_value(value))
            else:
                values[f.name] = _checked(f.name, python_value(value), hints[f.name])
    return cls(**values)


def run_sampling_defaults(given: Mapping[str, Any]) -> SamplingParams:
    """A run's sampling defaults from the options ``given`` by Python name (:func:`options_of`), with the fields of
    :data:`~batchgen.sampling.sampling_params.MODEL_SAMPLING_FIELDS` that are not given (absent or ``None``) left to
    the model's generation_config.json (``left_to_model``).

    Raises:
        BatchgenError: as :func:`options_of`.
    """
    left = tuple(name for name in MODEL_SAMPLING_FIELDS if given.get(name) is None)
    return options_of(SamplingParams, given, left_to_model=left)


def _parsed(f: Field[Any], value: Any) -> Any:
    """``value`` as the declared ``parse`` of option ``f`` reads it.

    Raises:
        BatchgenError: its error, named by the flag.
    """
    try:
        return f.metadata["parse"](value)
    except FieldError as e:
        raise BatchgenError(f"--{f.name.replace('_', '-')}: {e.message}") from None


def _checked(name: str, value: Any, hint: Any) -> Any:
    """Option ``name``'s ``value`` as its declared type ``hint`` takes it (see :func:`options_of`)."""
    flag = name.replace("_", "-")
    if get_origin(hint) is tuple:
        value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    elif hint in (str, str | None) and isinstance(value, (os.PathLike, torch.device)):
        value = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    if hint in (bool, bool | None) and not isinstance(value, bool):
        optional = hint is not bool
        if value is not None or not optional:
            hint = switch_hint(name)
            raise BatchgenError(f"--{flag}: must be True or False{' or None' * optional}, got {value!r}{hint}")
    elif (problem := type_problem(value, hint)) is not None:
        raise BatchgenError(
            f"--{flag}: must be {problem}, got {shown_value(list(value) if isinstance(value, tuple) else value)}"
        )
    if hint in (float, float | None) and value is not None:
        try:
            as_float = float(value)
        except OverflowError:
            raise BatchgenError(f"--{flag}: must be a finite number, got {shown_value(value)}") from None
        # numpy's long double, a Fraction: the float the run records (an int stays as given, for its messages)
        return value if isinstance(value, (int, float)) else as_float
    return value


def type_problem(value: Any, annotation: Any) -> str | None:
    """What ``value`` should be for an option declared ``annotation`` (``"an integer"``), or ``None`` if it is that:
    numpy's numbers count as numbers, a bool as no number, a float as no integer; ``X | None`` takes ``None``."""
    optional = [arg for arg in get_args(annotation) if arg is not type(None)]
    if len(optional) < len(get_args(annotation)):
        return None if value is None else type_problem(value, optional[0])
    if annotation is int:
        return None if isinstance(value, numbers.Integral) and not isinstance(value, bool) else "an integer"
    if annotation is float:
        return None if isinstance(value, numbers.Real) and not isinstance(value, bool) else "a number"
    if annotation is bool:
        return None if isinstance(value, bool) else "true or false"
    if annotation is str:
        return None if isinstance(value, str) else "a string"
    item = get_args(annotation)[0]
    if isinstance(value, tuple) and all(type_problem(v, item) is None for v in value):
        return None
    return "a string or a list of strings" if item is str else "a list of integers"
