"""Turn one raw input row into a checked request description."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchgen.errors import NOT_UNICODE, FieldError, RowError, is_unicode_text, shown_value
from batchgen.io.arrow_fit import misfit
from batchgen.io.chat_messages import check_messages, check_tools
from batchgen.io.input_options import template_arguments
from batchgen.io.input_row import InputRow
from batchgen.io.json_text import is_json_text
from batchgen.io.passthrough import (
    ADD_GENERATION_PROMPT_FIELD,
    CHAT_TEMPLATE_KWARGS_FIELD,
    CONTINUATION_FIELD,
    CONTINUE_FINAL_MESSAGE_FIELD,
    KNOWN_FIELDS,
    PROMPT_FIELDS,
    READ_AND_PASSED,
    TOOLS_FIELD,
    json_type_name,
)
from batchgen.io.row_ids import check_id
from batchgen.sampling.plain_values import whole_number
from batchgen.sampling.row_fields import SAMPLING_FIELD_ALIASES, SAMPLING_FIELDS

__all__ = ["PROMPT_FIELDS", "RowSpec", "parse_row"]

# Builds the RowError for one field of the row being parsed.
_Fail = Callable[[str, str], RowError]

# Where other tools' datasets keep the prompt (lower-cased field name) → the prompt field batchgen reads instead.
_PROMPT_FIELD_HINTS = {
    **{name: "prompt" for name in ("prompt", "text", "input", "inputs", "question", "instruction", "query", "content")},
    **{name: "messages" for name in ("messages", "message", "conversation", "conversations", "chat", "dialog")},
    **{name: "prompt_token_ids" for name in ("prompt_token_ids", "input_ids", "token_ids", "tokens", "prompt_ids")},
}
# The "no prompt" message names at most this many of the fields the row has.
_FIELDS_SHOWN = 5


@dataclass(frozen=True)
class RowSpec:
    """One checked input row.

    Exactly one of ``prompt``, ``messages`` and ``prompt_token_ids`` is set.

    Attributes:
        id: the row's ``id`` as a string, or its 0-based row index when it has none.
        line: 1-based line (JSONL) or row (Parquet) number, for messages.
        prompt: raw text prompt.
        messages: chat messages, each with string ``role`` and ``content`` (and any other string keys given; an
            assistant message's ``tool_calls`` with their arguments parsed: :mod:`batchgen.io.chat_messages`).
        prompt_token_ids: token ids (their vocabulary range is checked later, by the engine).
        continuation: text to score after ``prompt`` or ``messages`` (see ``batchgen.job.continuation``), or ``None``.
        chat_template_kwargs: keyword arguments of the chat template that renders ``messages`` (vLLM's field), or
            ``None``; a key given as null is left out (a Parquet struct column's rows hold every key).
        continue_final_message: whether the chat template leaves ``messages``' last message open, for the model to
            continue (vLLM's field), rather than open the assistant's turn after it (``add_generation_prompt``,
            the default; a row may also ask for neither); both ``False`` for a row without ``messages``.
        add_generation_prompt: see ``continue_final_message``.
        tools: the function definitions the chat template is given (vLLM's ``tools``), or ``None``; read from a
            ``messages`` row's ``tools`` field, which passes through too (a prompt row's is data).
        sampling_overrides: the row's sampling fields with their raw values, under the names the row gave them
            (``max_tokens`` too: see ``SAMPLING_FIELD_ALIASES``), for ``make_sampling_params``.
        passthrough: every field of the pass-through schema (``None`` where absent), under its schema name.
    """

    id: str
    line: int
    prompt: str | None
    messages: list[dict[str, Any]] | None
    prompt_token_ids: list[int] | None
    continuation: str | None
    chat_template_kwargs: dict[str, Any] | None
    continue_final_message: bool
    add_generation_prompt: bool
    tools: list[dict[str, Any]] | None
    sampling_overrides: dict[str, Any]
    passthrough: dict[str, Any]


def parse_row(
    row: InputRow,
    source: str,
    passthrough_schema: pa.Schema,
    passthrough_names: dict[str, str],
) -> RowSpec:
    """Check ``row`` and split it into prompt, id, sampling overrides and pass-through values.

    Args:
        row: a row from :class:`batchgen.io.reader.RowReader`.
        source: the input name for messages.
        passthrough_schema: the reader's ``passthrough_schema``.
        passthrough_names: the reader's ``passthrough_names``: each pass-through field's column; a field it
            lacks (only in a JSONL file changed after the reader read its schema) is a row error.

    Raises:
        RowError: naming the first offending field (see the messages below for what is checked), or the column
            the column options could not map (``row.problem``).
    """

    def fail(field: str, message: str) -> RowError:
        # A field the column options set is named by its column, the name the user knows.
        return RowError(source, row.line, row.columns.get(field, field), message)

    if row.problem is not None:
        raise RowError(source, row.line, *row.problem)
    data = row.data
    present = [name for name in PROMPT_FIELDS if data.get(name) is not None]
    if not present:
        raise fail(next((name for name in PROMPT_FIELDS if name in data), "prompt"), _no_prompt(data))
    if len(present) > 1:
        raise fail(present[1], f"give only one of {', '.join(PROMPT_FIELDS)} (found: {', '.join(present)})")
    kind = present[0]
    prompt = messages = token_ids = None
    if kind == "prompt":
        prompt = _check_prompt(data["prompt"], fail)
    elif kind == "messages":
        messages = check_messages(data["messages"], fail, row.struct_nulls)
    else:
        token_ids = _check_token_ids(data["prompt_token_ids"], fail)
    continued, generation_prompt = _check_prompt_end(data, kind, fail)
    return RowSpec(
        id=check_id(data.get("id"), row.index, fail),
        line=row.line,
        prompt=prompt,
        messages=messages,
        prompt_token_ids=token_ids,
        continuation=_check_continuation(data, kind, fail),
        chat_template_kwargs=_check_chat_template_kwargs(data.get(CHAT_TEMPLATE_KWARGS_FIELD), kind, fail),
        continue_final_message=continued,
        add_generation_prompt=generation_prompt,
        tools=check_tools(data.get(TOOLS_FIELD), row.struct_nulls, fail) if kind == "messages" else None,
        sampling_overrides={name: data[name] for name in (*SAMPLING_FIELDS, *SAMPLING_FIELD_ALIASES) if name in data},
        passthrough=_passthrough(data, passthrough_schema, passthrough_names, fail),
    )


def _no_prompt(data: dict[str, Any]) -> str:
    """The message for a row with no prompt: which prompt fields it gives as null (a JSONL row; Parquet's reader
    drops a row's nulls, its columns being every row's), the fields it has instead, and the rename (or the column
    option) that would make one of them its prompt (``text`` → ``prompt``) when one looks like a prompt under
    another tool's name."""
    # Found by a new user: a row with "prompt": null was said to have no prompt, the null unsaid.
    notes = [f"'{name}' is null" for name in PROMPT_FIELDS if name in data]
    found = [key for key, value in data.items() if key != "id" and value is not None]
    if not found:
        notes.append("it has no other field")
    else:
        shown = ", ".join(f"'{key}'" for key in found[:_FIELDS_SHOWN])
        if len(found) > _FIELDS_SHOWN:
            shown += f" and {len(found) - _FIELDS_SHOWN} more"
        notes.append(f"found {shown}")
        hint = next((key for key in found if key.lower() in _PROMPT_FIELD_HINTS), None)
        if hint is not None:
            which = "it" if len(found) == 1 else f"'{hint}'"
            field = _PROMPT_FIELD_HINTS[hint.lower()]
            flag = {"prompt": " or pass --prompt-column", "messages": " or pass --messages-column"}.get(field)
            notes.append(f"rename {which} to '{field}'{f'{flag} {hint}' if flag else ''}")
    return f"row has no prompt: give one of {', '.join(PROMPT_FIELDS)} ({'; '.join(notes)})"


def _check_continuation(data: dict[str, Any], prompt_field: str, fail: _Fail) -> str | None:
    value = data.get(CONTINUATION_FIELD)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        got = "an empty string" if value == "" else json_type_name(value)
        raise fail(CONTINUATION_FIELD, f"must be a non-empty string, got {got}")
    if not is_unicode_text(value):
        raise fail(CONTINUATION_FIELD, NOT_UNICODE)
    if prompt_field == "prompt_token_ids":
        raise fail(CONTINUATION_FIELD, "needs a text prompt or messages (with prompt_token_ids: prompt_logprobs_from)")
    if data.get("prompt_logprobs_from") is not None:
        raise fail("prompt_logprobs_from", "give either continuation or prompt_logprobs_from, not both")
    return value


def _check_chat_template_kwargs(value: Any, prompt_field: str, fail: _Fail) -> dict[str, Any] | None:
    """A row's ``chat_template_kwargs`` (:func:`~batchgen.io.input_options.template_arguments`), which only a
    ``messages`` row may give."""
    if value is None:
        return None
    try:
        arguments = template_arguments(value)
    except FieldError as e:
        raise fail(e.field, e.message) from None
    if prompt_field != "messages":
        raise fail(CHAT_TEMPLATE_KWARGS_FIELD, "needs messages: a prompt is not rendered by the chat template")
    return arguments


def _check_prompt_end(data: dict[str, Any], prompt_field: str, fail: _Fail) -> tuple[bool, bool]:
    """A row's ``continue_final_message`` and ``add_generation_prompt``, each a boolean or null (its default:
    ``False``, and ``True`` unless the last message is continued). Only a ``messages`` row gives one that is not its
    default, and not both ``True``: vLLM's rule, where the generation prompt would follow the open message."""
    values = {}
    for name in (CONTINUE_FINAL_MESSAGE_FIELD, ADD_GENERATION_PROMPT_FIELD):
        value = data.get(name)
        if value is not None and not isinstance(value, bool):
            raise fail(name, f"must be true or false, got {shown_value(value)}")
        values[name] = value
    continued = bool(values[CONTINUE_FINAL_MESSAGE_FIELD])
    generation_prompt = values[ADD_GENERATION_PROMPT_FIELD]
    if generation_prompt is None:
        generation_prompt = not continued
    if prompt_field != "messages":
        if continued or not generation_prompt:
            name = CONTINUE_FINAL_MESSAGE_FIELD if continued else ADD_GENERATION_PROMPT_FIELD
            raise fail(name, "needs messages: a prompt is not rendered by the chat template")
        return False, False
    if continued and generation_prompt:
        message = "true with add_generation_prompt true: the last message is continued, or the reply opened after it"
        raise fail(CONTINUE_FINAL_MESSAGE_FIELD, message)
    return continued, generation_prompt


def _check_prompt(value: Any, fail: _Fail) -> str:
    if not isinstance(value, str):
        raise fail("prompt", f"must be a string, got {json_type_name(value)}")
    if not is_unicode_text(value):  # JSON's \ud800 escapes can write one; no tokenizer takes it
        raise fail("prompt", NOT_UNICODE)
    return value


def _check_token_ids(value: Any, fail: _Fail) -> list[int]:
    if not isinstance(value, list) or not value:
        got = "an empty array" if isinstance(value, list) else json_type_name(value)
        raise fail("prompt_token_ids", f"must be a non-empty array of integers, got {got}")
    value = [whole_number(token) for token in value]  # 5.0: as the integer fields take it
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int):
            raise fail("prompt_token_ids", f"item {i} must be an integer, got {shown_value(token)}")
    return value


def _passthrough(data: dict[str, Any], schema: pa.Schema, names: dict[str, str], fail: _Fail) -> dict[str, Any]:
    values: dict[str, Any] = dict.fromkeys(schema.names)
    for key, value in data.items():
        if key in KNOWN_FIELDS:
            continue
        if not is_unicode_text(key):  # no Arrow column can be named so (found by a helper: a traceback)
            raise fail(key.encode("utf-8", "backslashreplace").decode(), f"its name {NOT_UNICODE}")
        name = names.get(key)
        if name is None and key in READ_AND_PASSED:
            continue  # read, and not passed through here
        if name is None:
            raise fail(key, "field not in the dataset when the run read its schema: was the file changed since?")
        values[name] = value
    for name, value in values.items():
        if value is not None:
            values[name], problem = _stored(value, schema.field(name))
            if problem is not None:
                raise fail(name, problem)
    return values


def passthrough_that_fits(data: dict[str, Any], schema: pa.Schema, names: dict[str, str]) -> dict[str, Any]:
    """The pass-through fields of a bad row that fit ``schema`` (the others null), for its error row; ``names``
    as :func:`parse_row` takes them."""
    values: dict[str, Any] = dict.fromkeys(schema.names)
    for key, value in data.items():
        name = names.get(key)
        if name is not None and value is not None:
            values[name] = _stored(value, schema.field(name))[0]
    return values


def _stored(value: Any, field: pa.Field) -> tuple[Any, str | None]:
    """What pass-through ``field`` stores for ``value`` (non-null): it, or its JSON text for a JSON-text field;
    ``(None, why)`` when it does not fit."""
    if is_json_text(field):
        text = json.dumps(value, ensure_ascii=False)
        if not is_unicode_text(text):
            return None, NOT_UNICODE
        return text, None
    problem = misfit(value, field.type)
    return (value, None) if problem is None else (None, problem)
