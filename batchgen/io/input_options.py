"""Input options: which of a dataset's own columns hold the prompt and the id; declared as the engine's are
(:mod:`batchgen.loop.options`): default, ``help`` per field, the rules in :meth:`InputOptions.validate`.
:mod:`batchgen.io.columns` applies them to the rows."""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass, field, fields
from typing import Any

from batchgen.errors import BatchgenError, FieldError
from batchgen.io.passthrough import (
    ADD_GENERATION_PROMPT_FIELD,
    CHAT_TEMPLATE_KWARGS_FIELD,
    CONTINUE_FINAL_MESSAGE_FIELD,
    json_type_name,
)

# Output metadata key of the input options a run used: a resumed run compares them, status reads ids with them.
INPUT_OPTIONS_KEY = "batchgen.input_options"
# The escapes --prompt-template and --stop understand: a shell passes "\n" in double quotes as a backslash and an n.
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}
_ESCAPE = re.compile(r"\\([nt\\])")
# The chat template's own arguments, which batchgen sets (the messages; a generation prompt, rendered as text).
_TEMPLATE_ARGUMENTS = ("conversation", "messages", "add_generation_prompt", "tokenize", "continue_final_message")


def apply_escapes(text: str) -> str:
    """``text`` with the escapes a command line cannot type otherwise (``\\n``, ``\\t``, ``\\\\``) turned into the
    characters they name; any other backslash stays."""
    return _ESCAPE.sub(lambda m: _ESCAPES[m.group(1)], text)


def template_arguments(value: Any) -> dict[str, Any]:
    """A row's ``chat_template_kwargs`` (vLLM's, e.g. ``{"enable_thinking": false}``), checked: keyword arguments of
    the chat template, a null one naming an argument left at the template's default (over a run's value).

    Raises:
        FieldError: not an object with string keys, a value that is no JSON value, or a key naming an argument
            batchgen sets itself.
    """
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        message = f"must be an object of template arguments, got {json_type_name(value)}"
        raise FieldError(CHAT_TEMPLATE_KWARGS_FIELD, message)
    try:
        json.dumps(value, allow_nan=False)  # the run records it; a row's JSON holds nothing else
    except (TypeError, ValueError) as e:
        raise FieldError(CHAT_TEMPLATE_KWARGS_FIELD, f"must hold JSON values only: {e}") from None
    taken = next((key for key in _TEMPLATE_ARGUMENTS if key in value), None)
    if taken is not None:
        if taken in (ADD_GENERATION_PROMPT_FIELD, CONTINUE_FINAL_MESSAGE_FIELD):
            message = (
                f"'{taken}' is a row field, not a template argument: give it beside messages, as vLLM's requests do"
            )
        else:
            message = f"'{taken}' is set by batchgen, not a template argument to give"
        raise FieldError(CHAT_TEMPLATE_KWARGS_FIELD, message)
    return dict(value)


def chat_template_kwargs(value: Any) -> dict[str, Any] | None:
    """``--chat-template-kwargs`` as a keyword, a config file or a flag (its JSON text) gives it: the checked
    :func:`template_arguments` without their null values; ``None`` for none, and for an object that names none.

    Raises:
        FieldError: text that is no JSON; as :func:`template_arguments`.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise FieldError(CHAT_TEMPLATE_KWARGS_FIELD, f"is not JSON: {e}") from None
    if value is None:
        return None
    given = {key: item for key, item in template_arguments(value).items() if item is not None}
    return given or None


@dataclass(frozen=True)
class InputOptions:
    """The dataset's side of ``batchgen run``; each field's meaning is its ``help``."""

    prompt_column: str | None = field(
        default=None, metadata={"help": "Read each row's text prompt from column NAME (instead of 'prompt')."}
    )
    messages_column: str | None = field(
        default=None,
        metadata={
            "help": "Read each row's chat messages from column NAME: {role, content} or ShareGPT {from, value} "
            "items; trailing assistant turns are dropped."
        },
    )
    prompt_template: str | None = field(
        default=None,
        metadata={
            "help": "Build each row's prompt from its columns: 'Question: {question}\\nAnswer:' (Python format "
            "fields; \\n, \\t and \\\\ are escapes)."
        },
    )
    id_column: str | None = field(default=None, metadata={"help": "Take each row's id from column NAME."})
    chat_template_kwargs: dict[str, Any] | None = field(
        default=None,
        metadata={
            "help": "Arguments of the chat template for every messages row, as a JSON object, "
            "'{\"enable_thinking\": false}' (a row's own chat_template_kwargs add to them, and win).",
            "parse": chat_template_kwargs,
            "metavar": "JSON",
        },
    )

    def validate(self) -> None:
        """Every rule of these options.

        Raises:
            BatchgenError: one line naming the first bad flag and its value.
        """
        given = [f"--{name.replace('_', '-')}" for name in self._prompt_options() if getattr(self, name) is not None]
        if len(given) > 1:
            raise BatchgenError(f"{given[0]} and {given[1]} exclude each other: give one way to make the prompt")
        for name in ("prompt_column", "messages_column", "id_column"):
            if getattr(self, name) == "":
                raise BatchgenError(f"--{name.replace('_', '-')}: give a column name")
        if self.prompt_template is not None:
            self.template_fields()

    @staticmethod
    def _prompt_options() -> tuple[str, ...]:
        return ("prompt_column", "messages_column", "prompt_template")

    @property
    def maps_prompt(self) -> bool:
        """Whether an option says where the prompt is."""
        return any(getattr(self, name) is not None for name in self._prompt_options())

    def template(self) -> str:
        """``prompt_template`` with its escapes (``\\n``, ``\\t``, ``\\\\``) turned into the characters they name."""
        assert self.prompt_template is not None
        return apply_escapes(self.prompt_template)

    def template_fields(self) -> list[tuple[str, str | None, str, str]]:
        """The template's parts, as :meth:`string.Formatter.parse` gives them: ``(literal, column, spec, conversion)``
        with ``column`` ``None`` after the last field.

        Raises:
            BatchgenError: braces that do not pair up, a positional field (``{}``, ``{0}``), a field that is not a
                plain column name (``{a.b}``, ``{a[0]}``), or a nested field in a format spec.
        """
        flag = "--prompt-template"
        try:
            parts = list(string.Formatter().parse(self.template()))
        except ValueError as e:
            raise BatchgenError(f"{flag} {self.prompt_template!r}: {e} (a literal brace is {{{{ or }}}})") from None
        checked = []
        for literal, name, spec, conversion in parts:
            if name is not None and (name == "" or name.isdigit()):
                raise BatchgenError(f"{flag} {self.prompt_template!r}: name a column in each field, as {{question}}")
            if name is not None and any(c in name for c in ".["):
                raise BatchgenError(f"{flag} {self.prompt_template!r}: field {{{name}}} must be a plain column name")
            if spec and "{" in spec:
                raise BatchgenError(f"{flag} {self.prompt_template!r}: a format spec cannot hold a field")
            if conversion not in (None, "r", "s", "a"):
                raise BatchgenError(f"{flag} {self.prompt_template!r}: conversion !{conversion} is not !r, !s or !a")
            checked.append((literal, name, spec or "", conversion or ""))
        if not any(name is not None for _, name, _, _ in checked):
            raise BatchgenError(f"{flag} {self.prompt_template!r}: names no column; put one in braces, as {{question}}")
        return checked

    def columns(self) -> list[str]:
        """Every column these options name, in the order of their flags (the template's in its order)."""
        named = [self.prompt_column, self.messages_column]
        if self.prompt_template is not None:
            named += [name for _, name, _, _ in self.template_fields()]
        named.append(self.id_column)
        return list(dict.fromkeys(name for name in named if name is not None))


def recorded_input_options(metadata: dict[bytes, bytes]) -> InputOptions:
    """The input options an output's schema ``metadata`` records (:data:`INPUT_OPTIONS_KEY`); none given for an
    output that records none (or unreadable ones: its rows were then read with none)."""
    try:
        data = json.loads(metadata.get(INPUT_OPTIONS_KEY.encode(), b"{}"))
        return InputOptions(**{f.name: data.get(f.name) for f in fields(InputOptions)})
    except (ValueError, TypeError, AttributeError):
        return InputOptions()
