"""``--config FILE.yaml``: a YAML mapping of long flag names whose values become a command's defaults (flags win)."""

from __future__ import annotations

from pathlib import Path

import typer

from batchgen.api.config_file import OPTION_HINTS, check_config_value, read_config
from batchgen.cli.user_errors import user_errors
from batchgen.errors import BatchgenError

# The keys that are no option: the dataset and the output.
_PATHS = ("dataset", "out")


def load_config(ctx: typer.Context, _param: typer.CallbackParam, value: Path | None) -> Path | None:
    """Eager ``--config`` callback: the YAML's keys become the command's defaults (flags still override)."""
    if value is None:
        return None
    with user_errors():
        params = {p.name: p for p in ctx.command.params if p.name is not None}
        # The options and the paths are keys; another of a command's parameters (status's --out) is none.
        defaults = read_config(value, {name for name in params if name in OPTION_HINTS or name in _PATHS})
        for name, item in defaults.items():
            if item is None:
                continue  # null: the option's own default
            if name in OPTION_HINTS or name in _PATHS:  # what click's conversion does not check
                check_config_value(value, name, item, OPTION_HINTS.get(name, str))
            if params[name].multiple and not isinstance(item, list):
                item = defaults[name] = [item]  # `stop: "."`: one value of a repeatable option, as on a row
            # Converted here, so that a bad value names the file; click would name only the option.
            try:
                params[name].process_value(ctx, item)
            except typer.BadParameter as e:
                raise BatchgenError(f"{value}: option '{name.replace('_', '-')}': {e.message}") from None
        ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value
