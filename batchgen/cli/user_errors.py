"""How CLI commands report user mistakes: one line on stderr, exit code 2 (3: bad rows left out), no traceback."""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import typer
from typer._click.core import Context  # the click typer vendors (typer's Context is one)
from typer._click.exceptions import (  # the click typer vendors
    ClickException,
    NoArgsIsHelpError,
    NoSuchOption,
    UsageError,
)
from typer.core import TyperGroup
from typer.exceptions import Abort

from batchgen.api.options import name_meant
from batchgen.errors import BatchgenError
from batchgen.io.field_warnings import NO_SUCH_OPTION
from batchgen.sampling.row_fields import ROW_FIELD_KEYWORDS


class BatchgenGroup(TyperGroup):
    """batchgen's commands: a usage mistake that the parser finds (an unknown flag or command, a value of the wrong
    type, a missing argument) is one line on stderr, ``batchgen: error: ...``, as batchgen's own checks write theirs,
    exit code 2, rather than click's three (usage, hint, error; found by a new user)."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        """As click's ``main``; in standalone mode (the console's) it exits, with the messages above."""
        run = functools.partial(super().main, args, prog_name, complete_var, False, windows_expand_args, **extra)
        if not standalone_mode:
            return run()
        try:
            code = run()  # a command's typer.Exit(n) comes back as n
        except NoArgsIsHelpError as e:  # `batchgen` alone: the help
            e.show()
            sys.exit(e.exit_code)
        except UsageError as e:
            if isinstance(e, NoSuchOption):
                _hint_meant_option(e)
            _hint_meant_command(e)
            # The command's path as it was run (`batchgen run`, `python -m batchgen run`); some errors know none.
            where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            print(f"batchgen: error: {e.format_message()}{where}", file=sys.stderr)
            sys.exit(e.exit_code)
        except ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except Abort:
            print("Aborted!", file=sys.stderr)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


# Other tools' commands for what a batchgen command does.
_OTHER_COMMANDS = {
    "run-batch": "vLLM's run-batch: batchgen run REQUESTS.jsonl --out RESULTS.jsonl reads its files",
    "generate": "batchgen run DATASET --out OUT generates",
    "serve": "batchgen runs offline, with no server: batchgen run DATASET --out OUT",
}


def _hint_meant_command(error: UsageError) -> None:
    """Say which batchgen command does what another tool's unknown command does (vLLM's ``run-batch``)."""
    name = next((name for name in _OTHER_COMMANDS if error.message == f"No such command {name!r}."), None)
    if name is not None:
        error.message = f"No such command {name!r} ({_OTHER_COMMANDS[name]})."


def _hint_meant_option(error: NoSuchOption) -> None:
    """Point an unknown flag that is another engine's name for one of the command's options at that option alone
    (``--max-model-len``: ``(Possible options: --context-length)``), where click lists flags of a like spelling;
    say what another engine's sampling flag is here (``--do-sample``: a temperature; ``--json-schema``: a row
    field; ``--num-beams``: none)."""
    if error.ctx is None:
        return
    name = error.option_name.lstrip("-").replace("-", "_")
    meant, note = name_meant(name)
    if meant is not None:
        flag = f"--{meant.replace('_', '-')}"
        if any(flag in param.opts for param in error.ctx.command.params):
            error.possibilities = [flag]
            return
        if meant not in ROW_FIELD_KEYWORDS:
            return  # an option of batchgen's that this command lacks (bench's --temperature): click's own list
        note = f"'{meant}' is a row field: give it in each row"
    elif note == NO_SUCH_OPTION:
        note = "another engine's option, which batchgen does not have"
    if note is not None:
        error.possibilities = []
        error.message = f"{error.message} ({note})"


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


def given(ctx: Context, name: str, config_too: bool = False) -> bool:
    """Whether the command's parameter ``name`` was given on the command line (not a default, nor a config's), or
    with ``config_too`` there or in the ``--config`` file."""
    return _source(ctx, name) in (("COMMANDLINE", "DEFAULT_MAP") if config_too else ("COMMANDLINE",))


def _source(ctx: Context, name: str) -> str:
    """Where parameter ``name``'s value came from, by the name of click's ``ParameterSource`` (compared by name: it
    lives in the click that typer vendors, not a public module)."""
    return getattr(ctx.get_parameter_source(name), "name", "")
