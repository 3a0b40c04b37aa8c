"""The commands' flags, derived from the options' declarations (:class:`~batchgen.loop.options.EngineOptions`,
:class:`~batchgen.sampling.sampling_params.SamplingParams`' run defaults, :class:`~batchgen.job.options.JobOptions`,
:class:`~batchgen.io.input_options.InputOptions`: the classes of :data:`batchgen.api.options.OPTION_CLASSES`).

A command names an options object among its parameters (``options: EngineOptions``); :func:`with_options` puts
one Typer option per declared field in its place (the ``help`` and ``flag`` of the field's metadata, its default,
its type: a tuple field is a repeatable flag) and hands the command the object built from the values given. So a
field added to one of those dataclasses is a flag of every command that takes the object, and a ``--config`` key.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Collection
from dataclasses import MISSING, Field, replace
from typing import Any, get_args, get_origin, get_type_hints

import typer
from typer._click.core import Context  # the click typer vendors: its commands take this Context
from typer._click.exceptions import UsageError
from typer._click.globals import get_current_context
from typer.core import TyperArgument, TyperCommand, TyperOption

from batchgen.api.config_file import config_options_replaced, parsed_text, value_type
from batchgen.api.options import OPTION_CLASSES, declared_options
from batchgen.cli import release_startup_interrupts
from batchgen.cli.user_errors import given
from batchgen.errors import FieldError, shown_value
from batchgen.io.input_options import apply_escapes
from batchgen.sampling.sampling_params import MODEL_SAMPLING_FIELDS, SamplingParams


def with_options(
    only: Collection[str] | None = None,
    required: Collection[str] = (),
    starts_until_its_handlers: bool = False,
    hidden: bool = False,
    config_keys: Collection[str] = (),
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorate a Typer command whose parameters include options objects (annotated with one of
    :data:`OPTION_CLASSES`): each such parameter becomes the flags of its class's declared fields (only those named
    in ``only``, when given; the others keep their defaults), and the command receives the built object.
    ``required`` names fields that become required flags (no default). ``starts_until_its_handlers``: a SIGTERM
    before the command puts its own handlers in place is one "while starting" (``run``: until rows run).
    ``hidden``: the flags work but stay out of ``--help`` (``status`` takes ``run``'s, which its help names).
    ``config_keys``: the command's own parameters that a ``--config`` key of their name sets, as it sets the options
    (bench's ``--report-memory``, which ``run``'s means too)."""

    def decorate(func: Callable[..., None]) -> Callable[..., None]:
        hints = get_type_hints(func)
        parameters: list[inspect.Parameter] = []
        groups: dict[str, tuple[type, list[str]]] = {}
        for parameter in inspect.signature(func).parameters.values():
            cls = hints.get(parameter.name)
            if cls not in OPTION_CLASSES:
                annotation = hints.get(parameter.name, parameter.annotation)
                parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=annotation))
                continue
            assert isinstance(cls, type)
            declared = [f for f in declared_options(cls) if only is None or f.name in only]
            groups[parameter.name] = (cls, [f.name for f in declared])
            field_hints = get_type_hints(cls)
            parameters += [_typer_parameter(f, field_hints[f.name], f.name in required, hidden) for f in declared]

        @functools.wraps(func)
        def command(**values: Any) -> None:
            release_startup_interrupts(still_starting=starts_until_its_handlers)
            _flags_replace_the_configs_options(values)
            for name, (cls, names) in groups.items():
                given = {n: values.pop(n) for n in names}
                values[name] = cls(**{n: tuple(v) if isinstance(v, list) else v for n, v in given.items()})
                if cls is SamplingParams:
                    values[name] = replace(values[name], left_to_model=_left_to_model(given))
            func(**values)

        command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        # The options this command declares, which a --config file's keys may set (batchgen.cli.config).
        keys = {n for _, names in groups.values() for n in names} | set(config_keys)
        command.option_names = frozenset(keys)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in parameters}
        return command

    return decorate


def _flags_replace_the_configs_options(values: dict[str, Any]) -> None:
    """A flag replaces the ``--config`` file's options it excludes (:func:`config_options_replaced`: ``--regex`` its
    ``json-schema``, ``--overwrite`` its ``resume``), as a flag replaces the file's value of its own option: those
    take their defaults (none, off); a flag given on the command line too stays."""
    ctx = get_current_context()
    flagged = {name: value for name, value in values.items() if given(ctx, name)}
    for name in config_options_replaced(flagged):
        if name in values and name not in flagged:
            values[name] = False if isinstance(values[name], bool) else None


def _left_to_model(values: dict[str, Any]) -> tuple[str, ...]:
    """The run defaults among ``values`` (the sampling flags' values) that the model's generation_config.json may
    set: those of :data:`MODEL_SAMPLING_FIELDS` that neither a flag nor a ``--config`` key gave (a key's null is
    the option's default: click's source for it is the default's)."""
    ctx = get_current_context()
    return tuple(name for name in MODEL_SAMPLING_FIELDS if name in values and not given(ctx, name, config_too=True))


def _typer_parameter(field: Field[Any], annotation: Any, required: bool, hidden: bool) -> inspect.Parameter:
    """The Typer option of one declared field (a ``tuple[X, ...]`` field: a repeatable ``list[X]`` option)."""
    default = field.default if field.default is not MISSING else ...
    if get_origin(annotation) is tuple:
        annotation = list[get_args(annotation)[0]]  # type: ignore[misc]
        default = list(default) if default is not ... else ...
    flags = [field.metadata["flag"]] if "flag" in field.metadata else []
    callback = _apply_escapes if field.metadata.get("escapes") else None
    repeats = get_origin(annotation) is list
    if "parse" in field.metadata:
        parser: Callable[[Any], Any] | None = _text_parser(field)
    elif value_type(annotation) in (int, float):
        parser = _number_parser(value_type(annotation), repeats)
    else:
        parser = None
    option = typer.Option(
        ... if required else default,
        *flags,
        help=field.metadata["help"],
        callback=callback,
        parser=parser,
        metavar=field.metadata.get("metavar"),
        hidden=hidden,
    )
    return inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


def _text_parser(option: Field[Any]) -> Callable[[Any], Any]:
    """The click parser of an option whose metadata declares how its values ``parse`` (``--prompt-logprobs``: true,
    false or a count): the flag's text read as a config file's is (:func:`~batchgen.api.config_file.parsed_text`);
    its error as click's bad value."""

    def parser(value: Any) -> Any:
        try:
            return parsed_text(option, value)
        except FieldError as e:
            raise typer.BadParameter(e.message) from None

    return parser


def _number_parser(kind: type, repeats: bool) -> Callable[[Any], Any]:
    """The click parser of an ``int`` or ``float`` option: the flag's text as that number, or click's bad value
    naming the text (typer's own words named neither the text nor the type)."""
    what = "an integer" if kind is int else "a number"

    def parser(value: Any) -> Any:
        if not isinstance(value, str):  # a --config file's value (YAML's 2 for a float option: 2.0, as click reads it)
            return float(value) if kind is float and type(value) is int else value
        try:
            return kind(value.strip())
        except ValueError:
            hint = " (give the flag once for each value)" if repeats and "," in value else ""
            raise typer.BadParameter(f"{shown_value(value)} is not {what}{hint}") from None

    return parser


def _apply_escapes(values: list[str] | None) -> list[str] | None:
    """A repeatable text option's values with their escapes applied (a field whose metadata sets ``escapes``)."""
    return None if values is None else [apply_escapes(value) for value in values]


class BatchgenCommand(TyperCommand):
    """A command whose usage line names its required options too: ``batchgen run [OPTIONS] DATASET --out OUT``
    (click's lists only the arguments, so a required ``--out`` surfaced only as an error), and which refuses
    another of its flags as an option's value, as argparse does (click took ``--stop --no-progress`` as the stop
    string ``"--no-progress"``; ``--stop=--no-progress`` still means that text)."""

    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        """Parse ``args`` as click does, after refusing a value-taking flag followed by another flag.

        Raises:
            UsageError: ``Option '--stop' requires an argument, got the flag '--no-progress' (...)``.
        """
        long_flag: dict[str, str] = {}  # a value-taking flag → its long spelling, where `--flag=value` works
        flags: set[str] = set()
        for param in self.get_params(ctx):
            if isinstance(param, TyperOption):
                flags.update(param.opts + param.secondary_opts)
                if not param.is_flag and not param.count:
                    long_flag.update(dict.fromkeys(param.opts, max(param.opts, key=len)))
        at = 0
        while at < len(args) and args[at] != "--":  # a lone -- ends the options, unless it is an option's value
            flag = args[at]
            if flag in long_flag and at + 1 < len(args):
                value = args[at + 1]
                if value.split("=", 1)[0] in flags:
                    raise UsageError(
                        f"Option '{flag}' requires an argument, got the flag '{value}' "
                        f"(write {long_flag[flag]}={value} if that is the text meant)",
                        ctx,
                    )
                at += 1
            at += 1
        return super().parse_args(ctx, args)

    def collect_usage_pieces(self, ctx: Context) -> list[str]:
        """The usage line after the command's name: ``[OPTIONS]``, the arguments, then each required option."""
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            name = (param.name or "").upper()
            if isinstance(param, TyperArgument):
                piece = f"{name}..." if param.nargs == -1 else name
                pieces.append(piece if param.required else f"[{piece}]")
            elif param.required:
                flag = max(param.opts, key=len)
                pieces.append(flag if getattr(param, "is_flag", False) else f"{flag} {name}")
        return pieces
