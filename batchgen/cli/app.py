"""The ``batchgen`` Typer app: its commands (``run``, ``status``, ``bench``, ``bench-one-batch``) and ``main``."""

from __future__ import annotations

import sys

import typer

from batchgen.cli import version_line
from batchgen.cli.bench import bench
from batchgen.cli.bench_one_batch import bench_one_batch
from batchgen.cli.options import BatchgenCommand
from batchgen.cli.run import run
from batchgen.cli.status import status
from batchgen.cli.user_errors import BatchgenGroup

app = typer.Typer(
    cls=BatchgenGroup,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    # Plain help: the rich layout truncates long flag names in an 80-column terminal.
    rich_markup_mode=None,
    help="Offline batch generation for Hugging Face-format causal LMs.",
)


def _print_version(value: bool) -> None:
    if value:
        print(version_line())
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print batchgen's version and exit."
    ),
) -> None:
    """Offline batch generation for Hugging Face-format causal LMs."""


app.command(cls=BatchgenCommand)(run)
app.command(cls=BatchgenCommand)(status)
app.command("bench-one-batch", cls=BatchgenCommand)(bench_one_batch)
app.command("bench", cls=BatchgenCommand)(bench)

# Options that take several values after one flag, SGLang style (``--batch-size 1 8 32``).
MULTI_VALUE_OPTIONS = ("--batch-size", "--input-len", "--output-len", "--baseline")


def expand_multi_value_options(argv: list[str]) -> list[str]:
    """Rewrite ``--batch-size 1 8 32`` as ``--batch-size 1 --batch-size 8 --batch-size 32`` for the parser."""
    out: list[str] = []
    current: str | None = None
    for arg in argv:
        if arg.startswith("-"):
            current = arg if arg in MULTI_VALUE_OPTIONS else None
            out.append(arg)
        elif current is not None and out[-1] != current:
            out += [current, arg]
        else:
            out.append(arg)
    return out


def main() -> None:
    """Console entry point (``batchgen`` and ``python -m batchgen``)."""
    app(args=expand_multi_value_options(sys.argv[1:]))
