"""How CLI commands report user mistakes: one line on stderr, exit code 2 (3: bad rows left out), no traceback."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from batchgen.errors import BatchgenError


@contextmanager
def user_errors(ctx: typer.Context | None = None) -> Iterator[None]:
    """Turn a :class:`BatchgenError` into one line on stderr and its exit code (2; 3 for bad rows left out).

    With the command's ``ctx``, a message about an option whose value came from its ``--config`` file names the
    file and the option first: the user never typed that flag.
    """
    try:
        yield
    except BatchgenError as e:
        message = str(e) if ctx is None else _name_config_source(str(e), ctx)
        print(f"batchgen: error: {message}", file=sys.stderr)
        raise typer.Exit(e.exit_status) from None


def _name_config_source(message: str, ctx: typer.Context) -> str:
    """``message`` with ``FILE: option 'name': `` in front when an option it names as ``--name`` was set in the
    ``--config`` file (the first such option); unchanged otherwise."""
    config = ctx.params.get("config")
    if config is None or message.startswith(f"{config}:"):
        return message
    for option in re.findall(r"--([a-z][a-z0-9-]*)", message):
        name = option.replace("-", "_")
        if name in ctx.params and _source(ctx, name) == "DEFAULT_MAP":
            return f"{config}: option '{option}': {message.removeprefix(f'--{option}: ')}"
    return message


def given(ctx: typer.Context, name: str) -> bool:
    """Whether the command's parameter ``name`` was given on the command line (not a default, nor a config's)."""
    return _source(ctx, name) == "COMMANDLINE"


def _source(ctx: typer.Context, name: str) -> str:
    """Where parameter ``name``'s value came from, by the name of click's ``ParameterSource`` (compared by name: it
    lives in the click that typer vendors, not a public module)."""
    return getattr(ctx.get_parameter_source(name), "name", "")
