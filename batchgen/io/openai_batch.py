"""OpenAI Batch input lines (``{"custom_id", "method", "url", "body"}``) read as batchgen rows.

A file is an OpenAI Batch file when its first JSON object has ``custom_id`` and ``body`` (and no prompt field);
then every line must be one. Each line becomes the row batchgen would read: ``custom_id`` is its ``id`` (and passes
through as the ``custom_id`` column), ``body.messages`` / ``body.prompt`` its prompt, and the body's sampling fields
batchgen's (see docs/input-output.md for the map). A line that is OpenAI-shaped but asks for something batchgen
cannot do (``tools``, ``stream: true``, an unknown body field, another endpoint) becomes an error row naming the
field, never a success that ignored part of the request.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from batchgen.errors import BatchgenError, RowError, shown_value
from batchgen.io.input_row import InputRow
from batchgen.io.passthrough import PROMPT_FIELDS, json_type_name
from batchgen.io.row_ids import error_row_id
from batchgen.sampling.sampling_params import whole_number

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
ENDPOINTS = (CHAT_URL, COMPLETIONS_URL)
# Builds the RowError for one field of the line being mapped.
_Fail = Callable[[str, str], RowError]
# The keys of a request line; one of them on a line marks it as OpenAI-shaped.
LINE_KEYS = ("custom_id", "method", "url", "body")

# Body fields copied to the row under batchgen's name (OpenAI's and vLLM's extra sampling fields, vLLM's chat
# template arguments).
_COPIED = {
    **{name: name for name in ("max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed")},
    **{name: name for name in ("presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty")},
    **{name: name for name in ("ignore_eos", "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output")},
    "min_tokens": "min_new_tokens",
    "chat_template_kwargs": "chat_template_kwargs",
}
# Body fields that change nothing batchgen writes, whatever their value (stream_options applies only to
# stream: true, which is refused; vLLM's files carry it without).
_HARMLESS = frozenset(("model", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options"))
# Body fields accepted only with the value that asks for nothing (null is always accepted: the default).
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "stream": (False,),
    "echo": (False,),
    "suffix": ("",),
    "logit_bias": ({},),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "function_call": ("none",),
    "modalities": (["text"],),
    # vLLM's chat extensions, in the value batchgen always does: the template's generation prompt after the messages.
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "guided_decoding_backend": ("xgrammar", "auto"),  # vLLM's: batchgen's grammars are xgrammar's
}
# vLLM's own structured-output fields of a request body: where batchgen takes the same constraint.
_VLLM_STRUCTURED = {
    "guided_json": 'give the schema as response_format {"type": "json_schema", "json_schema": {"schema": ...}}',
    **dict.fromkeys(("structured_outputs", "guided_decoding"), "a schema as response_format, others in rows"),
    "guided_regex": "give it as a batchgen row's regex (OpenAI's response_format has none)",
    "guided_grammar": "give it as a batchgen row's ebnf (OpenAI's response_format has none)",
    "guided_choice": "give a batchgen row a regex of the choices, a|b|c",
}
_CHAT_ONLY = frozenset(
    (
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "response_format",
        "modalities",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
    )
)
_COMPLETIONS_ONLY = frozenset(("prompt", "suffix", "best_of"))  # echo too, but vLLM's chat takes echo: false
_READ = (*_COPIED, "messages", "prompt", "logprobs", "top_logprobs", "response_format")
# Each batchgen row field → the request field it was read from, so that a row error names the request's field.
_CHAT_NAMES = {
    "id": "custom_id",
    **{name: f"body.{key}" for key, name in _COPIED.items()},
    "messages": "body.messages",
    "logprobs": "body.logprobs",
    "top_logprobs": "body.top_logprobs",
    "json_schema": "body.response_format",
}
_COMPLETIONS_NAMES = {
    **_CHAT_NAMES,
    "prompt": "body.prompt",
    "prompt_token_ids": "body.prompt",
    "top_logprobs": "body.logprobs",
}


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
        names = _COMPLETIONS_NAMES if data.get("url") == COMPLETIONS_URL else _CHAT_NAMES
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
            _check_body_field(key, value, url, given, fail)
        row = {_COPIED[key]: value for key, value in given.items() if key in _COPIED}
        row.update(_prompt(url, given, fail))
        row.update(_logprobs(url, given, fail))
        if "response_format" in given:
            row.update(_response_format(given["response_format"], fail))
        return row


def is_openai_batch_line(data: dict[str, Any]) -> bool:
    """Whether a row is an OpenAI Batch request line, a bad one too (a first line lacking its body is a 400 line): no
    batchgen prompt field nor a body of text, and two or more of custom_id, a body, method POST, a /v1/ url."""
    body, api = data.get("body", {}), str(data.get("url")).startswith("/v1/")
    marks = ["custom_id" in data, "body" in data, data.get("method") == "POST", api]
    return sum(marks) >= 2 and isinstance(body, dict | None) and not any(name in data for name in PROMPT_FIELDS)


def _check_body_field(key: str, value: Any, url: str, body: dict[str, Any], fail: _Fail) -> None:
    """Refuse a body field batchgen cannot honour (``value`` is not null)."""
    name = f"body.{key}"
    chat = url == CHAT_URL
    if (chat and key in _COMPLETIONS_ONLY) or (not chat and key in _CHAT_ONLY):
        raise fail(name, f"not a field of {url} requests")
    if key in _OFF_VALUES:
        if value not in _OFF_VALUES[key]:
            raise fail(name, f"{shown_value(value)} is not supported by batchgen; leave it out")
        return
    if key == "best_of":
        if value != body.get("n", 1):
            raise fail(name, f"best_of {shown_value(value)} is not supported (only best_of equal to n)")
        return
    if key in _HARMLESS or key in _READ:
        return
    other = _CHAT_ONLY if not chat else _COMPLETIONS_ONLY
    known = [k for k in (*_READ, *_HARMLESS, *_OFF_VALUES, "best_of") if k not in other]
    # 0.8: a typo (max_token, temprature, topp) and not another API's field (reasoning_effort ~ response_format).
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    if close:
        raise fail(name, f"not a field batchgen knows (did you mean '{close[0]}'?)")
    if key in _VLLM_STRUCTURED:
        raise fail(name, f"vLLM's structured output, which a batchgen request does not read: {_VLLM_STRUCTURED[key]}")
    raise fail(name, "not supported by batchgen; leave it out (the result would not be what it asks for)")


def _prompt(url: str, body: dict[str, Any], fail: _Fail) -> dict[str, Any]:
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


def _logprobs(url: str, body: dict[str, Any], fail: _Fail) -> dict[str, Any]:
    """batchgen's ``logprobs`` / ``top_logprobs`` for the body's: off unless the body asks (OpenAI's default); at
    most 20 top logprobs (OpenAI's cap for chat, vLLM's default ``max_logprobs`` for both endpoints)."""
    value = body.get("logprobs")
    if url == CHAT_URL:
        if value is not None and not isinstance(value, bool):
            raise fail("body.logprobs", f"must be true or false, got {shown_value(value)}")
        logprobs, top, name, limit = bool(value), body.get("top_logprobs", 0), "body.top_logprobs", "OpenAI's limit"
    elif value is None or value is False:
        return {"logprobs": False, "top_logprobs": 0}
    else:
        count = whole_number(value)  # 5.0: vLLM reads 5
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise fail("body.logprobs", f"must be a count of top logprobs (an integer >= 0), got {shown_value(value)}")
        logprobs, top, name, limit = True, count, "body.logprobs", "vLLM's default max_logprobs"
    if isinstance(top, int | float) and not isinstance(top, bool) and top > 20:
        raise fail(name, f"asks for {shown_value(body[name.removeprefix('body.')])} top logprobs; at most 20 ({limit})")
    return {"logprobs": logprobs, "top_logprobs": top}


def _response_format(value: Any, fail: _Fail) -> dict[str, Any]:
    """``{"type": "text"}``: nothing; ``json_object``: any JSON object; ``json_schema``: its ``schema``."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise fail("body.response_format", 'json_schema needs a "schema" object')
        return {"json_schema": schema}
    raise fail("body.response_format", f"type must be text, json_object or json_schema, got {shown_value(kind)}")


def _last_part(model: str) -> str:
    """``meta-llama/Llama-3.2-1B`` and ``/models/llama-3.2-1b/`` → ``llama-3.2-1b``: case folded, since hub ids
    keep their capitals and model directories and batchgen's built-in names often do not."""
    return model.rstrip("/").rsplit("/", 1)[-1].casefold()
