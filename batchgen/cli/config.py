"""``--config FILE.yaml``: a YAML mapping of long flag names whose values become a command's defaults (flags win)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from batchgen.api.config_file import OPTION_HINTS, check_config_value, read_config
from batchgen.cli.user_errors import user_errors
from batchgen.errors import BatchgenError

# The keys that are no option: the dataset and the output.
_PATHS = ("dataset", "out")


def load_config(ctx: typer.Context, _param: typer.CallbackParam, value: Path | None) -> Path | None:
    """Eager ``--config`` callback: the YAML's keys become the command's defaults (flags still override). A key of
    ``batchgen run`` that the command has not (``max-new-tokens`` or ``out`` for ``bench``), or that its own
    parameter of the name means otherwise (bench's ``--dataset`` and ``--seed``), is left aside, with one note
    naming them, so that one file serves a job and its benchmark."""
    if value is None:
        return None
    with user_errors():
        params = {p.name: p for p in ctx.command.params if p.name is not None}
        # The options the command declares (with_options) and the paths are keys; another of a command's parameters
        # (status's --out, bench's --seed of its workload) is none. The paths are a job's (run's, status's): bench's
        # --dataset is its workload's.
        paths = _PATHS if all(name in params for name in _PATHS) else ()
        declared: frozenset[str] = getattr(ctx.command.callback, "option_names", frozenset())
        read = read_config(value, set(OPTION_HINTS) | set(_PATHS))
        defaults = {name: item for name, item in read.items() if name in declared or name in paths}
        aside = [name for name in read if name not in defaults]
        if aside:
            flags = [name.replace("_", "-") for name in aside]
            # A parameter of the command's own under the name (bench's --seed of its workload) means another thing.
            own = "".join(
                f"; its own --{flag} means another thing" for name, flag in zip(aside, flags) if name in params
            )
            note = f"{', '.join(flags)}: not options of {ctx.info_name}, left aside{own}"
            print(f"batchgen: note: {value}: {note}", file=sys.stderr)
        for name, item in defaults.items():
            if item is None:
                continue  # null: the option's own default
            check_config_value(value, name, item, OPTION_HINTS.get(name, str))  # what click's conversion does not check
            if params[name].multiple and not isinstance(item, list):
                item = defaults[name] = [item]  # `stop: "."`: one value of a repeatable option, as on a row
            # Converted here, so that a bad value names the file; click would name only the option.
            try:
                params[name].process_value(ctx, item)
            except typer.BadParameter as e:
                raise BatchgenError(f"{value}: option '{name.replace('_', '-')}': {e.message}") from None
        ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value
