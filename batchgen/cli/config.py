"""``--config FILE.yaml``: a YAML mapping of long flag names whose values become a command's defaults (flags win)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args, get_type_hints

import typer

from batchgen.api.options import OPTION_CLASSES, declared_options, read_config
from batchgen.cli.user_errors import user_errors
from batchgen.errors import BatchgenError, shown_value


def load_config(ctx: typer.Context, _param: typer.CallbackParam, value: Path | None) -> Path | None:
    """Eager ``--config`` callback: the YAML's keys become the command's defaults (flags still override)."""
    if value is None:
        return None
    with user_errors():
        params = {p.name: p for p in ctx.command.params if p.name is not None}
        defaults = read_config(value, set(params))
        for name, item in defaults.items():
            if item is None:
                continue  # null: the option's own default
            option, given = name.replace("_", "-"), item
            if params[name].multiple and not isinstance(item, list):
                item = defaults[name] = [item]  # `stop: "."`: one value of a repeatable option, as on a row
            # Converted here, so that a bad value names the file; click would name only the option.
            try:
                converted = params[name].process_value(ctx, item)
            except typer.BadParameter as e:
                raise BatchgenError(f"{value}: option '{option}': {e.message}") from None
            if name in _TEXT_OPTIONS and not all(isinstance(v, (str, bool)) for v in _values(item)):
                # `stop: 5`: a row's stop must be a string, and so must this; YAML reads 5 as a number.
                raise BatchgenError(
                    f"{value}: option '{option}': takes text, got {shown_value(given)} (quote a value meant as text)"
                )
            if any(isinstance(v, bool) for v in _values(item)) and not all(
                isinstance(v, bool) for v in _values(converted)
            ):
                # click takes YAML's true as 1 (int(True)) or "True": a slip, not a value of this option.
                raise BatchgenError(f"{value}: option '{option}': takes no true/false value, got {shown_value(given)}")
        ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def _text_options() -> frozenset[str]:
    """The declared options whose values are text (``str``, ``str | None``, ``tuple[str, ...]``)."""
    names = []
    for cls in OPTION_CLASSES:
        hints = get_type_hints(cls)
        names += [f.name for f in declared_options(cls) if hints[f.name] is str or str in get_args(hints[f.name])]
    return frozenset(names)


_TEXT_OPTIONS = _text_options()


def _values(item: Any) -> list[Any]:
    """A config value as a list: itself, or its elements for a multi-value option."""
    return list(item) if isinstance(item, (list, tuple)) else [item]
