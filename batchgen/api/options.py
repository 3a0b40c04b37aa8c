"""Every options class of ``batchgen run`` (:data:`OPTION_CLASSES`), and options given by their Python names
(``batchgen.run(..., max_new_tokens=64)``) sorted into them; the command line's flags derive from the same
declarations (:mod:`batchgen.cli.options`)."""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from dataclasses import Field, fields
from typing import Any, TypeVar, get_origin, get_type_hints

from batchgen.errors import BatchgenError
from batchgen.io.input_options import InputOptions
from batchgen.job.options import JobOptions
from batchgen.loop.options import EngineOptions
from batchgen.sampling.sampling_params import SAMPLING_FIELD_ALIASES, SamplingParams, python_value

OPTION_CLASSES: tuple[type, ...] = (EngineOptions, SamplingParams, JobOptions, InputOptions)

T = TypeVar("T")


def declared_options(cls: type) -> list[Field[Any]]:
    """The fields of ``cls`` that are command-line options: those whose metadata has a ``help``."""
    return [f for f in fields(cls) if "help" in f.metadata]


def option_names(*classes: type) -> set[str]:
    """The Python names of the declared options of ``classes``."""
    return {f.name for cls in classes for f in declared_options(cls)}


def check_option_names(
    given: Mapping[str, Any], classes: tuple[type, ...], caller: str, also: Collection[str] = ()
) -> None:
    """Refuse a keyword that is no declared option of ``classes`` (nor one of ``also``), as Python refuses an
    unknown keyword argument.

    Raises:
        TypeError: ``{caller}() got an unexpected keyword argument 'name'``, with ``(did you mean 'other'?)`` for
            a row field's alias (vLLM's ``max_tokens``) or a near spelling of a known option.
    """
    known = option_names(*classes) | set(also)
    unknown = next((name for name in given if name not in known), None)
    if unknown is None:
        return
    alias = SAMPLING_FIELD_ALIASES.get(unknown)
    close = [alias] if alias in known else difflib.get_close_matches(unknown, sorted(known), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise TypeError(f"{caller}() got an unexpected keyword argument '{unknown}'{hint}")


def options_of(cls: type[T], given: Mapping[str, Any], **fixed: Any) -> T:
    """An object of options class ``cls`` from the values ``given`` by Python name (those not declared by ``cls``
    are left out: they belong to another class) and ``fixed`` (set whether declared or not, e.g. ``model``). A
    tuple option takes a list or tuple, or one value alone (``stop="\\n"``), as ``--config`` takes it.

    Raises:
        BatchgenError: a switch (a ``bool`` option) given anything but ``True`` or ``False`` (or ``None`` where that
            means its default is decided later): ``"false"`` or ``0`` would otherwise reach the run unchecked. Named
            by its flag, as any other bad value is (``--prefix-cache: must be True or False, got 0``).
    """
    hints = get_type_hints(cls)
    values = dict(fixed)
    for f in declared_options(cls):
        if f.name in given:
            value = python_value(given[f.name])  # numpy's values are values
            if get_origin(hints[f.name]) is tuple:
                value = tuple(map(python_value, value)) if isinstance(value, (list, tuple)) else (value,)
            elif hints[f.name] in (bool, bool | None) and not isinstance(value, bool):
                optional = hints[f.name] is not bool
                if value is not None or not optional:
                    flag = f.name.replace("_", "-")
                    raise BatchgenError(f"--{flag}: must be True or False{' or None' * optional}, got {value!r}")
            values[f.name] = value
    return cls(**values)
