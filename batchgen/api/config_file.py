"""``--config FILE.yaml`` and ``batchgen.run(config=...)``: a YAML mapping of long flag names to option values.

The command line hands the values to click as its defaults (:mod:`batchgen.cli.config`), which converts them as it
converts a flag's text; :func:`config_options` converts them the same way for Python, so that one file means the
same run from either.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import Field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from batchgen.api.options import OPTION_CLASSES, declared_options, name_meant, near_name, options_of, type_problem
from batchgen.errors import BatchgenError, FieldError, shown_value
from batchgen.io.input_options import apply_escapes
from batchgen.sampling.row_fields import switch_hint
from batchgen.sampling.sampling_params import GRAMMAR_FIELDS

# The declared options' types by Python name.
OPTION_HINTS = {f.name: get_type_hints(cls)[f.name] for cls in OPTION_CLASSES for f in declared_options(cls)}
# The options that take more than their type (prompt_logprobs: true, false or a count), by Python name.
_PARSED = {f.name: f for cls in OPTION_CLASSES for f in declared_options(cls) if "parse" in f.metadata}
# What click's boolean type reads as true or false (a flag's text, a config file's quoted value).
_TRUE, _FALSE = {"1", "true", "t", "yes", "y", "on"}, {"0", "false", "f", "no", "n", "off"}


def read_config(path: Path, known: set[str]) -> dict[str, Any]:
    """Option values by Python name from a ``--config`` file: a YAML mapping whose keys are long flag names
    (``max-new-tokens`` or ``max_new_tokens``), each one of ``known``.

    Raises:
        BatchgenError: unreadable file, invalid YAML, not a mapping, or an unknown option.
    """
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise BatchgenError(f"{path}: cannot read config: {' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise BatchgenError(f"{path}: expected a mapping of option names to values")
    defaults: dict[str, Any] = {}
    for key, item in data.items():
        name = str(key).replace("-", "_")
        if name not in known or name == "config":
            # Another engine's sampling name says more than a near spelling (HF's stop_strings is 'stop').
            meant, note = name_meant(name)
            near = meant if meant in known else near_name(name, known - {"config"})
            hint = f" (did you mean '{near.replace('_', '-')}'?)" if near else f" ({note})" if note else ""
            raise BatchgenError(f"{path}: unknown option '{key}'{hint}")
        defaults[name] = item
    return defaults


def check_config_value(path: Path, name: str, value: Any, hint: Any) -> None:
    """Refuse a YAML value of option ``name`` (declared ``hint``; ``str`` for the ``dataset`` and ``out`` paths) that
    is not one: a list where it takes one value (click would read ``["{prompt}"]`` as the text ``"['{prompt}']"``),
    a number or mapping where it takes text (``stop: 5``; quoted, it is the text), ``true``/``false`` where it takes
    no switch (click reads ``true`` as 1 or ``"True"``), a value that converts to no number where one is taken.

    Raises:
        BatchgenError: ``FILE: option 'stop': takes text, got 5 (quote a value meant as text)``,
            ``FILE: option 'temperature': must be a number, got "hot"``, ``FILE: option 'n': takes one value, got
            [2]``.
    """
    option, items = name.replace("_", "-"), value if isinstance(value, list) else [value]
    if name in _PARSED:
        try:
            parsed_text(_PARSED[name], value)
        except FieldError as e:
            raise BatchgenError(f"{path}: option '{option}': {e.message}") from None
        return
    if isinstance(value, list) and get_origin(hint) is not tuple:
        raise BatchgenError(f"{path}: option '{option}': takes one value, got {shown_value(value)}")
    base = value_type(hint)
    if base is str and not all(isinstance(v, str) for v in items):
        what = "no true/false value" if any(isinstance(v, bool) for v in items) else "text"
        quote = "" if what != "text" else " (quote a value meant as text)"
        raise BatchgenError(f"{path}: option '{option}': takes {what}, got {shown_value(value)}{quote}")
    if base is not bool and any(isinstance(v, bool) for v in items):
        raise BatchgenError(f"{path}: option '{option}': takes no true/false value, got {shown_value(value)}")
    if any((problem := type_problem(_converted(v, base), base)) is not None for v in items):
        hint = switch_hint(name)
        raise BatchgenError(f"{path}: option '{option}': must be {problem}, got {shown_value(value)}{hint}")


def config_options(path: Path) -> dict[str, Any]:
    """The options of the ``--config`` file ``path`` by Python name, as ``batchgen.run(config=...)`` takes them,
    converted as the command line converts them: text of a number where one is taken (``"4"``, YAML's ``1e-3``,
    which it reads as text), a whole float where an integer is (``5.0``), click's words for true and false, one
    value where a list is; ``--stop``'s escapes applied; ``null`` left out (the option's default). The keys
    ``dataset`` and ``out`` are ``batchgen run``'s arguments.

    Raises:
        BatchgenError: the file cannot be read, is no mapping, names an unknown option, or gives one a value it
            does not take (naming the file).
    """
    escapes = {f.name for cls in OPTION_CLASSES for f in declared_options(cls) if f.metadata.get("escapes")}
    values = read_config(path, {*OPTION_HINTS, "dataset", "out"})
    options: dict[str, Any] = {}
    for name, value in values.items():
        if value is None:
            continue
        check_config_value(path, name, value, OPTION_HINTS.get(name, str))
        if name in ("dataset", "out"):
            options[name] = value
            continue
        base = value_type(OPTION_HINTS[name])
        if name in _PARSED:
            value = parsed_text(_PARSED[name], value)
        elif get_origin(OPTION_HINTS[name]) is tuple:
            value = [_converted(item, base) for item in (value if isinstance(value, list) else [value])]
            value = [apply_escapes(item) for item in value] if name in escapes else value
        else:
            value = _converted(value, base)
        options[name] = value
    for cls in OPTION_CLASSES:
        try:
            options_of(cls, options)
        except BatchgenError as e:
            raise BatchgenError(f"{path}: {e}") from None
    return options


def with_config(config: str | os.PathLike[str] | None, given: dict[str, Any]) -> dict[str, Any]:
    """The options of the config file ``config`` (none without one, :func:`config_options`) with those ``given``
    over them, as flags over a ``--config`` (a constraint given, ``regex``, over the file's of any kind); a value
    given as ``None`` counts as not given (a wrapper passing its own unset arguments keeps the file's values).

    Raises:
        BatchgenError: as :func:`config_options`.
    """
    from_file = config_options(Path(config)) if config is not None else {}
    given = {name: value for name, value in given.items() if value is not None}
    replaced = config_options_replaced(given)
    return {name: value for name, value in from_file.items() if name not in replaced} | given


# Options that exclude each other (JobOptions.validate): the one given on replaces the others in a config file.
_EXCLUDED = {"overwrite": ("resume", "resume_force"), "resume": ("overwrite",), "resume_force": ("overwrite",)}


def config_options_replaced(given: Mapping[str, Any]) -> tuple[str, ...]:
    """The options of a ``--config`` file that the options ``given`` over it (by name, with their values) replace:
    every other constraint kind, where one is given (``regex`` over the file's ``json-schema``), as a row's
    constraint replaces the run's; and ``resume``/``resume_force`` under an ``overwrite`` given on, or ``overwrite``
    under one of them (found by a helper: a file's ``resume: true`` made ``--overwrite`` an error, where flags
    override the file)."""
    replaced = [name for name in GRAMMAR_FIELDS if name not in given] if set(given) & set(GRAMMAR_FIELDS) else []
    return (*replaced, *(other for name, others in _EXCLUDED.items() if given.get(name) for other in others))


def parsed_text(option: Field[Any], value: Any) -> Any:
    """A flag's text or a config file's value of ``option`` as its declared ``parse`` reads it, the text read first
    as a switch or a count (:func:`text_value`) where the option takes those (``metadata["words"]``:
    ``--prompt-logprobs true``), as it is elsewhere (``--dtype yes`` is no switch).

    Raises:
        FieldError: the ``parse``'s.
    """
    return option.metadata["parse"](text_value(value) if option.metadata.get("words") else value)


def text_value(value: Any) -> Any:
    """A flag's text, or a quoted YAML value, read as an option that takes a switch or a count takes it
    (``--prompt-logprobs``): a whole number's text as that integer, click's words for true and false (``yes``,
    ``off``) as the bool; any other value as it is."""
    if not isinstance(value, str):
        return value
    word = value.strip().lower()
    try:
        return int(word)
    except ValueError:
        return True if word in _TRUE else False if word in _FALSE else value


def value_type(hint: Any) -> Any:
    """The type of one value of an option declared ``hint``: ``int`` for ``int | None`` and ``tuple[int, ...]``."""
    args = [arg for arg in get_args(hint) if arg is not type(None) and arg is not Ellipsis]
    return args[0] if args else hint


def _converted(value: Any, base: Any) -> Any:
    """One YAML ``value`` as click converts it to ``base``; left as it is where it does not convert (the options'
    checks then name it)."""
    if base is bool and isinstance(value, (str, int)) and not isinstance(value, bool):
        word = str(value).strip().lower()
        return True if word in _TRUE else False if word in _FALSE else value
    if base is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if base in (int, float) and isinstance(value, str):
        try:
            return base(value.strip())
        except ValueError:
            return value
    return value
