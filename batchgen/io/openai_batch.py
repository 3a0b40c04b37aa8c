"""OpenAI Batch input lines (``{"custom_id", "method", "url", "body"}``) read as batchgen rows.

A file is an OpenAI Batch file when its first JSON object has ``custom_id`` and ``body`` (and no prompt field);
then every line must be one. Each line becomes the row batchgen would read: ``custom_id`` is its ``id`` (and passes
through as the ``custom_id`` column), ``body.messages`` / ``body.prompt`` its prompt, and the body's sampling fields
batchgen's (see docs/input-output.md for the map). A line that is OpenAI-shaped but asks for something batchgen
cannot do (``tools``, ``stream: true``, an unknown body field, another endpoint) becomes an error row naming the
field, never a success that ignored part of the request.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from batchgen.errors import BatchgenError, RowError, shown_value
from batchgen.io.input_row import InputRow
from batchgen.io.openai_fields import (
    CHAT_URL,
    COMPLETIONS_URL,
    COPIED,
    ENDPOINTS,
    Fail,
    check_body_field,
    constraint_fields,
    request_names,
)
from batchgen.io.passthrough import PROMPT_FIELDS, json_type_name
from batchgen.io.row_ids import error_row_id
from batchgen.sampling.plain_values import whole_number

# The keys of a request line; one of them on a line marks it as OpenAI-shaped.
LINE_KEYS = ("custom_id", "method", "url", "body")


@dataclass
class OpenAIBatchInput:
    """The OpenAI Batch side of one input file: its endpoint and the models its lines name.

    Attributes:
        url: the file's endpoint: that of its first line with a supported one (``None`` until one is read); OpenAI
            runs one endpoint per batch, and so does batchgen, so a line with the other one is an error line.
        models: each ``body.model`` value read → where the first line naming it is (``file:line``).
        given_ids: the error row id of each line whose ``custom_id`` is set but not a usable string → that
            ``custom_id`` as given (``5``), so that its error line echoes it and a client can match it back.
    """

    url: str | None = None
    models: dict[str, str] = field(default_factory=dict)
    given_ids: dict[str, Any] = field(default_factory=dict)
    loaded_model: str | None = None  # set by :meth:`expect_model`
    _warned: bool = False

    def expect_model(self, loaded: str) -> None:
        """Note the model that runs every line (``--model`` as given), and warn, once for the file, when a line's
        ``body.model`` names another: batchgen ignores it (a file written for vLLM names an HF repo id, one for
        OpenAI a model of theirs). The names agree when their last path parts do, ignoring case."""
        self.loaded_model = loaded
        for model, where in self.models.items():
            self._check_model(model, where)

    def _check_model(self, model: str, where: str) -> None:
        loaded = self.loaded_model
        if self._warned or loaded is None or _last_part(model) == _last_part(loaded):
            return
        self._warned = True
        tqdm.write(
            f"batchgen: warning: {where}: body.model '{model}' is not the loaded model '{loaded}'; "
            f"batchgen ignores body.model and runs every line on '{loaded}' (said once for the file)",
            file=sys.stderr,
        )

    def row(self, item: InputRow) -> InputRow:
        """The batchgen row of the request line ``item``: its ``columns`` name the request field behind each row
        field (``max_tokens`` → ``body.max_tokens``, ``id`` → ``custom_id``), and a line batchgen cannot run gets
        its field and message as its ``problem``; a bad line's row holds only its id: its ``custom_id``, as given
        when it is not a string (:func:`~batchgen.io.row_ids.error_row_id` makes it the error row's id).

        Raises:
            BatchgenError: the line is not an OpenAI Batch request line at all (a mixed file).
        """
        data, source, line = item.data, item.source, item.line
        if not any(key in data for key in LINE_KEYS):
            raise BatchgenError(
                f"{source}:{line}: not an OpenAI Batch request line, but the file's first line is one; "
                "a file holds one kind of row (give every line custom_id, method, url and body)"
            )
        custom_id = data.get("custom_id")
        names = request_names(data.get("url"), data.get("body"))
        row: dict[str, Any] = {}
        if isinstance(custom_id, str) and custom_id.strip():
            row = {"id": custom_id, "custom_id": custom_id}
        elif custom_id is not None:
            row = {"id": custom_id}  # its error row's id: 5 → "5", as batchgen status reads the echoed 5
        try:
            return InputRow(item.index, line, {**row, **self._mapped(data, line, source)}, source, names)
        except RowError as e:
            mapped = InputRow(item.index, line, row, source, names, (e.field or "", e.message))
            if "custom_id" not in row and custom_id is not None:
                self.given_ids[error_row_id(mapped)] = custom_id
            return mapped

    def _mapped(self, data: dict[str, Any], line: int, source: str) -> dict[str, Any]:
        def fail(name: str, message: str) -> RowError:
            return RowError(source, line, name, message)

        custom_id = data.get("custom_id")  # first: a line whose custom_id is bad claims no id (claims_id)
        if not isinstance(custom_id, str) or not custom_id.strip():
            raise fail("custom_id", f"must be a non-empty string, got {shown_value(custom_id)}")
        for key in data:
            if key not in LINE_KEYS:
                raise fail(key, "not a field of an OpenAI Batch request line (custom_id, method, url, body)")
        if data.get("method") != "POST":
            raise fail("method", f'must be "POST", got {shown_value(data.get("method"))}')
        url = data.get("url")
        if url not in ENDPOINTS:
            raise fail("url", f"must be {CHAT_URL} or {COMPLETIONS_URL}, got {shown_value(url)}")
        if self.url is None:
            self.url = url
        elif url != self.url:
            raise fail("url", f"{url}, but this file's requests go to {self.url} (one endpoint per file)")
        body = data.get("body")
        if not isinstance(body, dict):
            raise fail("body", f"must be an object, got {json_type_name(body)}")
        given = {key: value for key, value in body.items() if value is not None}
        model = given.get("model")
        if model is not None:
            if not isinstance(model, str):
                raise fail("body.model", f"must be a string, got {shown_value(model)}")
            if model not in self.models:
                self.models[model] = f"{source}:{line}"
                self._check_model(model, self.models[model])
        for key, value in given.items():
            check_body_field(key, value, url, given, fail)
        # OpenAI's chat: max_tokens is max_completion_tokens' old name; both must say the same.
        both = "max_tokens" in given and "max_completion_tokens" in given
        if both and given.pop("max_tokens") != given["max_completion_tokens"]:
            raise fail("body.max_completion_tokens", "and body.max_tokens differ: give one (the same limit)")
        row = {COPIED[key]: value for key, value in given.items() if key in COPIED}
        row.update(_prompt(url, given, fail))
        tools = given.get("tools") if url == CHAT_URL else None
        if isinstance(tools, str):  # a row may give their JSON text; vLLM's request model refuses it
            raise fail("body.tools", "must be an array of function definitions, got a string (JSON text)")
        if tools:  # [] is no tools: the template's own default
            row["tools"] = [_as_vllm_tool(tool) for tool in tools] if isinstance(tools, list) else tools
        row.update(_logprobs(url, given, fail))
        row.update(constraint_fields(given, fail))
        return row


def is_openai_batch_line(data: dict[str, Any]) -> bool:
    """Whether a row is an OpenAI Batch request line, a bad one too (a first line lacking its body is a 400 line): no
    batchgen prompt field nor a body of text, and two or more of custom_id, a body, method POST, a /v1/ url."""
    body, api = data.get("body", {}), str(data.get("url")).startswith("/v1/")
    marks = ["custom_id" in data, "body" in data, data.get("method") == "POST", api]
    return sum(marks) >= 2 and isinstance(body, dict | None) and not any(name in data for name in PROMPT_FIELDS)


def _prompt(url: str, body: dict[str, Any], fail: Fail) -> dict[str, Any]:
    if url == CHAT_URL:
        if "messages" not in body:
            raise fail("body.messages", "required for /v1/chat/completions")
        return {"messages": body["messages"]}  # its text content parts joined as a row's are (parse_row)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt_token_ids": prompt}
    if isinstance(prompt, list) and len(prompt) > 1:
        raise fail("body.prompt", f"holds {len(prompt)} prompts; batchgen takes one per line (split it into lines)")
    raise fail("body.prompt", f"must be a string or an array of token ids, got {shown_value(prompt)}")


def _as_vllm_tool(tool: Any) -> Any:
    """A request's function definition as vLLM hands it to the chat template (its pydantic model dumped: ``type``,
    then ``function`` with ``name``, ``description`` and ``parameters``, null where not given, then any other key),
    so that a template that prints a tool as JSON prints what vLLM's would; another shape is left for
    :func:`batchgen.io.chat_messages.check_tools` to refuse."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        return tool
    function = tool["function"]
    # name has no default (a tool without one is refused as lacking it); description and parameters have null.
    declared = {"name": function["name"]} if "name" in function else {}
    declared |= {"description": function.get("description"), "parameters": function.get("parameters")}
    rest = {key: part for key, part in tool.items() if key not in ("type", "function")}
    return {"type": tool.get("type", "function"), "function": {**declared, **function}, **rest}


def _logprobs(url: str, body: dict[str, Any], fail: Fail) -> dict[str, Any]:
    """batchgen's ``logprobs`` / ``top_logprobs`` for the body's: off unless the body asks (OpenAI's default; a
    completions ``false`` too, which vLLM's request model reads as 0); at most 20 top logprobs (OpenAI's cap for chat,
    vLLM's default ``max_logprobs`` for both endpoints)."""
    value = body.get("logprobs")
    if url == CHAT_URL:
        if value is not None and not isinstance(value, bool):
            raise fail("body.logprobs", f"must be true or false, got {shown_value(value)}")
        logprobs, top, name, limit = bool(value), body.get("top_logprobs", 0), "body.top_logprobs", "OpenAI's limit"
    elif value is None or value is False:
        return {"logprobs": False, "top_logprobs": 0}
    else:
        count = 1 if value is True else whole_number(value)  # true and 5.0: vLLM's pydantic reads 1 and 5
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise fail("body.logprobs", f"must be a count of top logprobs (an integer >= 0), got {shown_value(value)}")
        logprobs, top, name, limit = True, count, "body.logprobs", "vLLM's default max_logprobs"
    if isinstance(top, int | float) and not isinstance(top, bool) and top > 20:
        raise fail(name, f"asks for {shown_value(body[name.removeprefix('body.')])} top logprobs; at most 20 ({limit})")
    return {"logprobs": logprobs, "top_logprobs": top}


def _last_part(model: str) -> str:
    """``meta-llama/Llama-3.2-1B`` and ``/models/llama-3.2-1b/`` → ``llama-3.2-1b``: case folded, since hub ids
    keep their capitals and model directories and batchgen's built-in names often do not."""
    return model.rstrip("/").rsplit("/", 1)[-1].casefold()
