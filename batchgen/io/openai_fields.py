"""The body fields of an OpenAI Batch request line: which batchgen reads (and under which row field), which change
nothing it writes, which it takes only with the value that asks for nothing (OpenAI's and vLLM's defaults, so that a
file made by dumping vLLM request objects runs), and the one-line refusal of any other."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from batchgen.errors import RowError, shown_value

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
ENDPOINTS = (CHAT_URL, COMPLETIONS_URL)
# Builds the RowError for one field of the line being mapped.
Fail = Callable[[str, str], RowError]

# Body fields copied to the row under batchgen's name (OpenAI's and vLLM's extra sampling fields, vLLM's chat
# template arguments and prompt end).
COPIED = {
    **{name: name for name in ("max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed")},
    **{name: name for name in ("presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty")},
    **{name: name for name in ("ignore_eos", "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output")},
    "min_tokens": "min_new_tokens",
    # vLLM's chat extensions: how the template ends the prompt.
    **{name: name for name in ("chat_template_kwargs", "add_generation_prompt", "continue_final_message")},
    # Ids of the model's vocabulary (logit_bias' JSON keys: strings), as vLLM reads them; OpenAI's are its own
    # tokenizer's. allowed_token_ids is vLLM's.
    **{name: name for name in ("logit_bias", "allowed_token_ids", "bad_words")},
    "truncate_prompt_tokens": "truncate_prompt_tokens",  # vLLM's left truncation
}
# vLLM's structured-output body fields (its guided_* fields, and the keys of its structured_outputs object, vLLM
# 0.11 on) → the row's constraint field; xgrammar, batchgen's backend, is vLLM's default one.
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "ebnf", "guided_choice": "choice"}
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "grammar": "ebnf", "choice": "choice"}
# structured_outputs' other keys, taken at the values that ask for nothing (json_object true is read).
_STRUCTURED_OFF = {
    **dict.fromkeys(("disable_fallback", "disable_additional_properties", "json_object"), (False,)),
    # batchgen's JSON has no free whitespace, which either value allows (true asks for none).
    "disable_any_whitespace": (False, True),
}
# Body fields that change nothing batchgen writes, whatever their value (stream_options applies only to
# stream: true, which is refused; vLLM's files carry it without; vLLM's request_id names nothing batchgen writes,
# whose line ids are digests of the run's seed and custom_id, as on a resume).
_HARMLESS = frozenset(
    ("model", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options", "request_id")
)
# Body fields accepted only with the value that asks for nothing (null is always accepted: the default).
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "stream": (False,),
    "echo": (False,),
    "prompt_logprobs": (False,),  # vLLM's, as return_token_ids
    "return_token_ids": (False,),
    "suffix": ("",),
    "functions": ([],),
    # Tools go to the chat template either way, as vLLM gives them; "required" or a named tool would need the call
    # constrained to the tools' schemas.
    "tool_choice": ("none", "auto"),
    "function_call": ("none",),
    "modalities": (["text"],),
    "guided_decoding_backend": ("xgrammar", "auto"),  # vLLM's: batchgen's grammars are xgrammar's
    "guided_whitespace_pattern": (),  # vLLM's for guided_json; batchgen's schemas allow no free whitespace
    # vLLM's sampling extensions at their defaults, as a dumped vLLM request carries them (a helper's trial).
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "priority": (0,),
    "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,),  # the lines give each token's text, as OpenAI's do
    "include_reasoning": (True,),  # batchgen splits no reasoning out of the text
}
# vLLM's body fields batchgen's OpenAI output lines have no place for, and where what they ask for is.
_ELSEWHERE = {
    "echo": "a line's text is its completion alone; to score a prompt, give it as a batchgen row with "
    "prompt_logprobs (docs/input-output.md, Sampling fields)",
    "prompt_logprobs": "the output lines carry no prompt logprobs; give the prompt as a batchgen row with "
    "prompt_logprobs, whose output row holds them (docs/input-output.md, Sampling fields)",
    "return_token_ids": "the output lines give tokens as text; an .arrow or .parquet --out of the same file holds "
    "each line's output_token_ids",
}
_CHAT_ONLY = frozenset(
    (
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "modalities",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
    )
)
_COMPLETIONS_ONLY = frozenset(("prompt", "suffix"))  # echo too, but vLLM's chat takes echo: false (and best_of)
_READ = (*COPIED, *GUIDED, "structured_outputs", "messages", "prompt", "logprobs", "top_logprobs", "response_format")
_READ += ("tools",)
# Each batchgen row field → the request field it was read from, so that a row error names the request's field.
CHAT_NAMES = {
    "id": "custom_id",
    **{name: f"body.{key}" for key, name in COPIED.items()},
    "messages": "body.messages",
    "logprobs": "body.logprobs",
    "top_logprobs": "body.top_logprobs",
    "json_schema": "body.response_format",
    "tools": "body.tools",
}
COMPLETIONS_NAMES = {
    **CHAT_NAMES,
    "prompt": "body.prompt",
    "prompt_token_ids": "body.prompt",
    "top_logprobs": "body.logprobs",
}


def check_body_field(key: str, value: Any, url: str, body: dict[str, Any], fail: Fail) -> None:
    """Refuse a body field batchgen cannot honour (``value`` is not null).

    Raises:
        RowError: (``fail``'s) naming the field as the line spells it (``body.tools``) and why.
    """
    name = f"body.{key}"
    chat = url == CHAT_URL
    if (chat and key in _COMPLETIONS_ONLY) or (not chat and key in _CHAT_ONLY):
        raise fail(name, f"not a field of {url} requests")
    if key in _OFF_VALUES:
        if not any(_same(value, off) for off in _OFF_VALUES[key]):
            raise fail(
                name, _unsupported(value, _OFF_VALUES[key]) + (f": {_ELSEWHERE[key]}" if key in _ELSEWHERE else "")
            )
        return
    if key == "add_special_tokens":  # a prompt gets the tokenizer's BOS; chat messages only their template's
        if not _same(value, not chat):
            does = "adds them to a prompt" if not chat else "adds none to chat messages (their template has them)"
            raise fail(name, f"{shown_value(value)} is not supported: batchgen {does}; leave it out")
        return
    if key == "tools" and not chat:  # vLLM's completions have no tools: no template renders them
        if value != []:
            raise fail(name, f"not a field of {url} requests (a chat request's tools go to its chat template)")
        return
    if key == "best_of":
        if not _same(value, body.get("n", 1)):
            raise fail(name, f"best_of {shown_value(value)} is not supported (only best_of equal to n)")
        return
    if key in _HARMLESS or key in _READ:
        return
    other = _CHAT_ONLY if not chat else _COMPLETIONS_ONLY
    known = [k for k in (*_READ, *_HARMLESS, *_OFF_VALUES, "best_of", "add_special_tokens") if k not in other]
    # 0.8: a typo (max_token, temprature, topp) and not another API's field (reasoning_effort ~ response_format).
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    if close:
        raise fail(name, f"not a field batchgen knows (did you mean '{close[0]}'?)")
    if key == "guided_decoding":  # SamplingParams' field, which a dumped request does not carry
        raise fail(name, "vLLM's SamplingParams field; a request body gives structured_outputs or response_format")
    raise fail(name, "not supported by batchgen; leave it out (the result would not be what it asks for)")


def _same(value: Any, off: Any) -> bool:
    """Whether a body value is ``off``, a JSON boolean only where ``off`` is one (``0`` is no ``false``)."""
    return bool(value == off) and isinstance(value, bool) == isinstance(off, bool)


def _unsupported(value: Any, offs: tuple[Any, ...]) -> str:
    """Why a body value other than ``offs`` (the values that ask for nothing) is refused."""
    only = f" (or give {' or '.join(shown_value(off) for off in offs)})" if offs else ""
    return f"{shown_value(value)} is not supported by batchgen; leave it out{only}"


def constraint_fields(body: dict[str, Any], fail: Fail) -> dict[str, Any]:
    """The row's structured-output constraint from a request ``body`` (null fields left out): OpenAI's
    ``response_format``, vLLM's ``guided_*`` fields or the keys of its ``structured_outputs`` object.

    Raises:
        RowError: (``fail``'s) two constraints, a ``response_format`` or ``structured_outputs`` of another shape, or a
            ``structured_outputs`` key batchgen cannot honour; each naming its field.
    """
    found = {}  # the request field → (the row's field, its value)
    schema = _response_format(body["response_format"], fail) if "response_format" in body else None
    if schema is not None:
        found["body.response_format"] = ("json_schema", schema)
    found.update({f"body.{key}": (field, body[key]) for key, field in GUIDED.items() if key in body})
    structured = body.get("structured_outputs")
    if structured is not None and not isinstance(structured, dict):
        raise fail("body.structured_outputs", f"must be an object, got {shown_value(structured)}")
    for key, value in (structured or {}).items():
        name = f"body.structured_outputs.{key}"
        if key in STRUCTURED_OUTPUTS and value is not None:
            found[name] = (STRUCTURED_OUTPUTS[key], value)
        elif key == "json_object" and value is True:
            found[name] = ("json_schema", {"type": "object"})
        elif key not in _STRUCTURED_OFF and value is not None:
            close = difflib.get_close_matches(key, [*STRUCTURED_OUTPUTS, *_STRUCTURED_OFF], n=1, cutoff=0.7)
            meant = f"did you mean '{close[0]}'?" if close else f"{shown_value(value)} is not supported by batchgen"
            raise fail(name, f"not a key batchgen reads ({meant}); leave it out")
        elif value is not None and not any(_same(value, off) for off in _STRUCTURED_OFF.get(key, ())):
            raise fail(name, _unsupported(value, _STRUCTURED_OFF.get(key, ())))
    if len(found) > 1:
        raise fail(list(found)[1], f"give one structured-output constraint (found: {', '.join(found)})")
    return dict(found.values())


def _response_format(value: Any, fail: Fail) -> dict[str, Any] | None:
    """The schema of ``response_format``: ``{"type": "text"}``, none; ``json_object``, any JSON object;
    ``json_schema``, its ``schema``."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise fail("body.response_format", 'json_schema needs a "schema" object')
        return schema
    raise fail("body.response_format", f"type must be text, json_object or json_schema, got {shown_value(kind)}")


def request_names(url: Any, body: Any) -> dict[str, str]:
    """Each batchgen row field → the request field a line of endpoint ``url`` with ``body`` gave it under, so that a
    row error names the request's field (``json_schema`` → ``body.guided_json`` where the line gave that)."""
    names = dict(COMPLETIONS_NAMES if url == COMPLETIONS_URL else CHAT_NAMES)
    if not isinstance(body, dict):
        return names
    names.update({field: f"body.{key}" for key, field in GUIDED.items() if body.get(key) is not None})
    structured = body.get("structured_outputs")
    if isinstance(structured, dict):
        given = {key: field for key, field in STRUCTURED_OUTPUTS.items() if structured.get(key) is not None}
        names.update({field: f"body.structured_outputs.{key}" for key, field in given.items()})
    return names
