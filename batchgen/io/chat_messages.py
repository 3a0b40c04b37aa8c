"""A chat row's ``messages`` and ``tools``, checked and put in the shape a Hugging Face chat template takes, as
vLLM's chat endpoint puts them (``vllm/entrypoints/chat_utils.py``, ``_postprocess_messages``):

- a message's ``content`` is a string, or OpenAI's text parts (joined by newlines), or, in an assistant message,
  null or absent (it is then ``""``, as vLLM gives it: a turn that only calls tools);
- an assistant message's ``tool_calls`` are OpenAI's ``[{"id", "type": "function", "function": {"name",
  "arguments"}}]``, each call's ``arguments`` (a JSON object's text, as OpenAI sends it) parsed into the object
  tool-use templates render (null or ``""``: ``{}``); an empty list is dropped;
- a message's other keys are strings (``name``, ``tool_call_id``, ``reasoning_content``...); null and empty-list
  values are left out (an OpenAI SDK message dump's ``refusal: null`` and ``annotations: []``);
- ``tools`` are OpenAI's function definitions (or their JSON text; ``""`` and ``null`` are none), handed to the
  template's ``tools`` argument as given; a template that does not render tools leaves them out of the prompt, as
  in vLLM and transformers (a run warns: :func:`batchgen.io.field_warnings.warn_about_unrendered_tools`).

Where vLLM replaces arguments that are not a JSON object with ``{}`` (with a warning), batchgen refuses the row,
naming the message: the prompt would not show what the dataset says the model called.

A row of a Parquet or Arrow dataset (``struct_nulls``) holds its objects as structs, which give every object of a
column every key any of them has, null where it had none: there the null values inside tool calls and tools are
left out, so that a call's arguments and a tool's schema are the row's own (a null that means something survives
only in JSON text, which every dataset format keeps as it is).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from batchgen.errors import NOT_UNICODE, RowError, is_unicode_text, shown_value
from batchgen.io.passthrough import TOOLS_FIELD, json_type_name

# Builds the RowError for one field of the row being parsed.
Fail = Callable[[str, str], RowError]


def check_messages(value: Any, fail: Fail, struct_nulls: bool = False) -> list[dict[str, Any]]:
    """A row's ``messages`` as the chat template takes them (see the module docstring).

    Raises:
        RowError: (through ``fail``) naming the message and what is wrong with it.
    """
    if not isinstance(value, list) or not value:
        got = "an empty array" if isinstance(value, list) else json_type_name(value)
        raise fail("messages", f"must be a non-empty array of {{role, content}} objects, got {got}")
    return [_check_message(item, i, fail, struct_nulls) for i, item in enumerate(value)]


def _check_message(item: Any, i: int, fail: Fail, struct_nulls: bool) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise fail("messages", f"item {i} must be an object, got {json_type_name(item)}")
    empty = lambda part: part is None or (isinstance(part, list) and not part)  # noqa: E731
    item = {key: part for key, part in item.items() if key in ("role", "content") or not empty(part)}
    calls = item.pop("tool_calls", None)
    if calls is not None and not isinstance(calls, list):
        raise fail("messages", f"item {i}: 'tool_calls' must be an array, got {json_type_name(calls)}")
    if calls and item.get("role") != "assistant":
        role = shown_value(item.get("role"))
        raise fail("messages", f"item {i}: 'tool_calls' belong to an assistant message, not to role {role}")
    if isinstance(item.get("content"), list):
        item["content"] = _joined_text_parts(item["content"], i, fail)
    if item.get("role") == "assistant" and item.get("content") is None:
        item["content"] = ""  # as vLLM gives an assistant's null content (a turn that only calls tools)
    for key in ("role", "content"):
        if key not in item:
            # The row's own messages field: a messages column's ShareGPT items were mapped before this check.
            sharegpt = "from" in item
            hint = " (ShareGPT's {from, value} items: --messages-column messages reads them)" if sharegpt else ""
            raise fail("messages", f"item {i}: '{key}' is missing{hint}")
    for key, part in item.items():
        if not isinstance(part, str):
            raise fail("messages", f"item {i}: '{key}' must be a string, got {json_type_name(part)}")
        if not is_unicode_text(part):
            raise fail("messages", f"item {i}: '{key}' {NOT_UNICODE}")
    if calls:
        calls = _without_nulls(calls) if struct_nulls else calls
        item["tool_calls"] = [_check_tool_call(call, i, j, fail) for j, call in enumerate(calls)]
    return item


def _check_tool_call(call: Any, i: int, j: int, fail: Fail) -> dict[str, Any]:
    """Tool call ``j`` of message ``i``, its arguments parsed."""
    where = f"item {i}: tool_calls[{j}]"
    if not isinstance(call, dict):
        raise fail("messages", f"{where} must be an object, got {json_type_name(call)}")
    call = {key: part for key, part in call.items() if part is not None}
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise fail("messages", f'{where} must be a function call: {{"type": "function", "function": {{...}}}}')
    if not isinstance(function.get("name"), str):
        raise fail("messages", f"{where}: function {_name_problem(function)}")
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise fail("messages", f"{where}: function 'arguments' is not JSON ({e})") from None
    elif arguments is None or arguments == "":
        arguments = {}
    if not isinstance(arguments, dict):
        raise fail("messages", f"{where}: function 'arguments' must be a JSON object, got {json_type_name(arguments)}")
    return {**call, "function": {**function, "arguments": arguments}}


def _joined_text_parts(parts: list[Any], i: int, fail: Fail) -> str:
    """Message ``i``'s OpenAI content parts (``[{"type": "text", "text": ...}]``) as one string, joined by newlines as
    vLLM joins them; other parts (images, audio) are refused."""
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else json_type_name(part)
        if kind != "text":
            raise fail("messages", f"item {i}: content part {shown_value(kind)} is not supported (text only)")
        if not isinstance(part.get("text"), str):
            raise fail(
                "messages", f"item {i}: a text part's 'text' must be a string, got {shown_value(part.get('text'))}"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def check_tools(value: Any, struct_nulls: bool, fail: Fail) -> list[dict[str, Any]] | None:
    """A ``messages`` row's ``tools`` (``None``: none): an array of OpenAI's function definitions (``[{"type":
    "function", "function": {"name", "description", "parameters"}}]``) or of bare ones (``{"name", ...}``, as xLAM's
    datasets keep them), as given, or that array's JSON text; ``""``, ``null`` and ``[]`` are none.

    Raises:
        RowError: (through ``fail``) naming the tool and what is wrong with it.
    """
    if isinstance(value, str):  # datasets often keep them as JSON text (a Parquet column cannot type a schema)
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise fail(TOOLS_FIELD, f"is a string but not JSON ({e})") from None
        struct_nulls = False  # JSON text's nulls are its own
    if value is None or (isinstance(value, list) and not value):
        return None
    if not isinstance(value, list):
        raise fail(TOOLS_FIELD, f"must be an array of function definitions, got {json_type_name(value)}")
    tools = _without_nulls(value) if struct_nulls else value
    for j, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise fail(TOOLS_FIELD, f'item {j} must be {{"type": "function", "function": {{"name": ...}}}}')
        if not isinstance(function.get("name"), str):
            raise fail(TOOLS_FIELD, f"item {j}: function {_name_problem(function)}")
    return tools


def _name_problem(function: dict[str, Any]) -> str:
    """What is wrong with a function's ``name``: missing, or not a string."""
    if function.get("name") is None:
        return "'name' is missing"
    return f"'name' must be a string, got {shown_value(function['name'])}"


def _without_nulls(value: Any) -> Any:
    """``value`` with every null value of its objects left out, at every depth (a struct column's filling)."""
    if isinstance(value, dict):
        return {key: _without_nulls(part) for key, part in value.items() if part is not None}
    if isinstance(value, list):
        return [_without_nulls(part) for part in value]
    return value
