"""OpenAI Batch request lines read as batchgen rows: the field map (OpenAI's Batch and chat/completions API
reference, vLLM's extra body fields), the lines refused, and the choice of output format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchgen.errors import BatchgenError, RowError
from batchgen.io.input_options import InputOptions
from batchgen.io.openai_output import result_fields, wants_openai_output
from batchgen.io.reader import InputRow, RowReader
from batchgen.io.rows import parse_row

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# As vLLM's run-batch documentation writes a request line.
VLLM_DOCS_LINE = {
    "custom_id": "request-1",
    "method": "POST",
    "url": CHAT,
    "body": {
        "model": "meta-llama/Meta-Llama-3-8B-Instruct",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello world!"},
        ],
        "max_completion_tokens": 1000,
    },
}


def request(custom_id: str, body: dict[str, Any], url: str = CHAT, **line: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body, **line}


def chat(**body: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **body}


def read(tmp_path: Path, lines: list[Any]) -> tuple[RowReader, list[InputRow | RowError]]:
    path = tmp_path / "requests.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    reader = RowReader(path)
    return reader, list(reader)


def rows(tmp_path: Path, lines: list[Any]) -> list[InputRow]:
    reader, items = read(tmp_path, lines)
    assert all(isinstance(item, InputRow) for item in items)
    return [item for item in items if isinstance(item, InputRow)]


def test_the_vllm_docs_line_is_a_chat_row_with_its_custom_id(tmp_path: Path) -> None:
    reader, items = read(tmp_path, [VLLM_DOCS_LINE])
    assert reader.openai is not None and reader.openai.url == CHAT
    assert reader.passthrough_schema.names == ["custom_id"]  # the one column an OpenAI file adds
    (row,) = items
    assert isinstance(row, InputRow) and row.problem is None
    assert row.data == {
        "id": "request-1",
        "custom_id": "request-1",
        "messages": VLLM_DOCS_LINE["body"]["messages"],
        "max_completion_tokens": 1000,
        "logprobs": False,  # OpenAI reports logprobs only when asked
        "top_logprobs": 0,
    }
    spec = parse_row(row, reader.source, reader.passthrough_schema, reader.passthrough_names)
    assert spec.id == "request-1" and spec.passthrough == {"custom_id": "request-1"}
    assert spec.sampling_overrides["max_completion_tokens"] == 1000


def test_sampling_fields_map_onto_batchgen_names(tmp_path: Path) -> None:
    body = chat(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        n=3,
        stop="END",
        seed=11,
        presence_penalty=0.1,
        frequency_penalty=0.2,
        logprobs=True,
        top_logprobs=4,
        top_k=5,
        min_p=0.05,
        repetition_penalty=1.1,
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[9],
        user="u",
        metadata={"k": "v"},
        store=False,
        stream=False,
        tools=None,
    )
    (row,) = rows(tmp_path, [request("a", body)])
    assert row.problem is None
    mapped = {k: v for k, v in row.data.items() if k not in ("id", "custom_id", "messages")}
    assert mapped == {
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "n": 3,
        "stop": "END",
        "seed": 11,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "logprobs": True,
        "top_logprobs": 4,
        "top_k": 5,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "min_new_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [9],
    }


def test_vllms_chat_extensions_at_what_batchgen_does_are_read(tmp_path: Path) -> None:
    """vLLM's chat request fields (its ChatCompletionRequest: add_generation_prompt true, continue_final_message and
    echo false by default) given at those defaults ask for what batchgen does: read, not refused (found by a vLLM
    user: add_generation_prompt true was "not supported", echo "not a field"); include_stop_str_in_output is read
    as the sampling field it is."""
    vllm = {"add_generation_prompt": True, "continue_final_message": False, "echo": False}
    (row,) = rows(tmp_path, [request("a", chat(**vllm, include_stop_str_in_output=True))])
    assert row.problem is None and row.data["messages"] == chat()["messages"]
    assert row.data["include_stop_str_in_output"] is True  # batchgen's sampling field of that name
    (row,) = rows(tmp_path, [request("a", chat(chat_template_kwargs={"enable_thinking": False}))])
    assert row.data["chat_template_kwargs"] == {"enable_thinking": False}  # the row field of that name
    (row,) = rows(tmp_path, [request("a", chat(guided_decoding_backend="xgrammar"))])
    assert row.problem is None  # batchgen's grammars are xgrammar's: a request asking for it asks for nothing more


def test_a_completions_body_may_give_a_response_format(tmp_path: Path) -> None:
    """vLLM's CompletionRequest takes response_format as its chat requests do (found by a vLLM user: refused as
    "not a field of /v1/completions requests")."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    (row,) = rows(tmp_path, [request("p", {"model": "m", "prompt": "x", "response_format": fmt}, COMPLETIONS)])
    assert row.problem is None and row.data["json_schema"] == schema


def test_vllms_prompt_end_fields_are_the_rows(tmp_path: Path) -> None:
    """vLLM's ChatCompletionRequest continues the last message (found by a vLLM user: refused before)."""
    body = chat(add_generation_prompt=False, continue_final_message=True)
    (row,) = rows(tmp_path, [request("a", body)])
    assert row.problem is None
    assert (row.data["add_generation_prompt"], row.data["continue_final_message"]) == (False, True)


# vLLM's request fields at their defaults (vllm/sampling_params.py's SamplingParams and the OpenAI protocol's
# ChatCompletionRequest / CompletionRequest: best_of 1, use_beam_search false, length_penalty 1.0, bad_words [],
# spaces_between_special_tokens true, priority 0, add_special_tokens false for chat and true for completions, a
# request_id), as a file made by dumping vLLM request objects has them (a helper's trial: each was refused).
VLLM_DEFAULTS = {
    "best_of": 1,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "bad_words": [],
    "spaces_between_special_tokens": True,
    "priority": 0,
    "request_id": "chatcmpl-1",
    "return_tokens_as_token_ids": False,
    "include_reasoning": True,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "skip_special_tokens": True,
    "ignore_eos": False,
    "stop_token_ids": [],
    "include_stop_str_in_output": False,
    "echo": False,
}


def test_vllms_request_fields_at_their_defaults_ask_for_nothing(tmp_path: Path) -> None:
    lines = [request("c", chat(**VLLM_DEFAULTS, add_special_tokens=False, add_generation_prompt=True))]
    (row,) = rows(tmp_path, lines)
    assert row.problem is None
    prompt = {"model": "m", "prompt": "Once", **VLLM_DEFAULTS, "add_special_tokens": True}
    (row,) = rows(tmp_path, [request("p", prompt, COMPLETIONS)])
    assert row.problem is None


@pytest.mark.parametrize(
    ("field", "value", "url", "says"),
    [
        ("use_beam_search", True, CHAT, "true is not supported by batchgen; leave it out (or give false)"),
        ("length_penalty", 0.5, CHAT, "0.5 is not supported by batchgen; leave it out (or give 1.0)"),
        ("priority", True, CHAT, "true is not supported by batchgen; leave it out (or give 0)"),  # a bool is no 1
        ("spaces_between_special_tokens", False, COMPLETIONS, "leave it out (or give true)"),
        ("add_special_tokens", True, CHAT, "batchgen adds none to chat messages (their template has them)"),
        ("add_special_tokens", False, COMPLETIONS, "batchgen adds them to a prompt"),
        ("best_of", 3, CHAT, "best_of 3 is not supported (only best_of equal to n)"),
    ],
)
def test_vllms_request_fields_off_their_defaults_are_refused(
    tmp_path: Path, field: str, value: Any, url: str, says: str
) -> None:
    body = chat() if url == CHAT else {"model": "m", "prompt": "Once"}
    _, (item,) = read(tmp_path, [request("a", {**body, field: value}, url)])
    assert isinstance(item, InputRow) and item.problem is not None
    assert item.problem[0] == f"body.{field}" and says in item.problem[1], item.problem


def test_completions_prompts_and_their_logprobs_count(tmp_path: Path) -> None:
    lines = [
        request("text", {"model": "m", "prompt": "Once upon", "logprobs": 3, "stop": ["\n", "."]}, COMPLETIONS),
        request("ids", {"model": "m", "prompt": [1, 2, 3], "logprobs": 0, "echo": False}, COMPLETIONS),
        request("one", {"model": "m", "prompt": ["Once"], "best_of": 1}, COMPLETIONS),
        # vLLM's request model (pydantic, lax) reads true as 1 (a helper's vLLM file).
        request("true", {"model": "m", "prompt": "x", "logprobs": True, "prompt_logprobs": False}, COMPLETIONS),
    ]
    text, ids, one, true = rows(tmp_path, lines)
    assert (true.data["logprobs"], true.data["top_logprobs"], true.problem) == (True, 1, None)
    assert text.data["prompt"] == "Once upon" and (text.data["logprobs"], text.data["top_logprobs"]) == (True, 3)
    assert text.data["stop"] == ["\n", "."]
    assert ids.data["prompt_token_ids"] == [1, 2, 3] and (ids.data["logprobs"], ids.data["top_logprobs"]) == (True, 0)
    assert one.data["prompt"] == "Once" and one.data["logprobs"] is False
    assert all(row.problem is None for row in (text, ids, one))


def test_response_formats_become_json_schema_constraints(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    lines = [
        request("s", chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})),
        request("o", chat(response_format={"type": "json_object"})),
        request("t", chat(response_format={"type": "text"})),
    ]
    s, o, t = rows(tmp_path, lines)
    assert s.data["json_schema"] == schema
    assert o.data["json_schema"] == {"type": "object"}
    assert "json_schema" not in t.data


def test_vllms_structured_output_fields_are_the_rows_constraints(tmp_path: Path) -> None:
    """vLLM's guided_* body fields and its structured_outputs object (StructuredOutputsParams: json, regex, choice,
    grammar, json_object; vllm/sampling_params.py) give the row's constraint, as vLLM's xgrammar backend compiles
    them (found by a vLLM user: every one was refused); their other keys at vLLM's defaults ask for nothing."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    lines = [
        request("gj", chat(guided_json=schema)),
        request("gr", chat(guided_regex="[ab]+")),
        request("gg", chat(guided_grammar='root ::= "x"')),
        request("gc", chat(guided_choice=["yes", "no"])),
        request("sj", chat(structured_outputs={"json": schema, "disable_fallback": False, "regex": None})),
        request("sc", chat(structured_outputs={"choice": ["a"], "disable_any_whitespace": True})),
        request("so", chat(structured_outputs={"json_object": True})),
        request("sf", chat(structured_outputs={"json_object": False}, guided_grammar='root ::= "y"')),
        # The model's token ids, as vLLM reads them.
        request("lb", chat(logit_bias={"5": -100, "7": 2.5}, allowed_token_ids=[5, 7, 9], bad_words=["x y"])),
    ]
    got = {row.data["id"]: row for row in rows(tmp_path, lines)}
    assert all(row.problem is None for row in got.values())
    constraint_fields = ("json_schema", "regex", "ebnf", "choice")
    assert {key: {f: row.data[f] for f in constraint_fields if f in row.data} for key, row in got.items()} == {
        "gj": {"json_schema": schema},
        "gr": {"regex": "[ab]+"},
        "gg": {"ebnf": 'root ::= "x"'},
        "gc": {"choice": ["yes", "no"]},
        "sj": {"json_schema": schema},
        "sc": {"choice": ["a"]},
        "so": {"json_schema": {"type": "object"}},
        "sf": {"ebnf": 'root ::= "y"'},
        "lb": {},
    }
    limits = ("logit_bias", "allowed_token_ids", "bad_words")
    assert [got["lb"].data[name] for name in limits] == [{"5": -100, "7": 2.5}, [5, 7, 9], ["x y"]]


def test_text_content_parts_are_joined_and_others_refused(tmp_path: Path) -> None:
    """vLLM joins a message's text parts with a newline (its chat utilities' ``_parse_chat_message_content_parts``);
    batchgen runs no images or audio. Checked as any row's messages are (parse_row), named as the request's field."""
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    image = [{"type": "text", "text": "one"}, {"type": "image_url"}]
    lines = [request(rid, chat(messages=[{"role": "user", "content": c}])) for rid, c in (("a", parts), ("b", image))]
    reader, (first, second) = read(tmp_path, lines)
    assert isinstance(first, InputRow) and isinstance(second, InputRow)
    spec = parse_row(first, reader.source, reader.passthrough_schema, reader.passthrough_names)
    assert spec.messages == [{"role": "user", "content": "one\ntwo"}]
    with pytest.raises(RowError) as raised:
        parse_row(second, reader.source, reader.passthrough_schema, reader.passthrough_names)
    error = raised.value
    assert (error.line, error.field) == (2, "body.messages")
    assert error.message == 'item 0: content part "image_url" is not supported (text only)'


def test_a_chat_lines_tools_reach_its_template_as_vllm_dumps_them(tmp_path: Path) -> None:
    """vLLM hands the template each tool as its pydantic model dumps it (vLLM's protocol.py: ChatCompletionToolsParam
    with a FunctionDefinition of name, description and parameters, null where not given), with tool_choice auto or
    none alike; a bad tool is named as the request's field."""
    tool = {"strict": True, "function": {"parameters": {"type": "object"}, "name": "f"}}
    lines = [
        request("a", chat(tools=[tool], tool_choice="auto")),
        request("b", chat(tools=[{"function": {"name": 5}}])),
        request("c", chat(tools=[{"type": "function", "function": {"description": "d"}}])),
    ]
    reader, (first, *bad) = read(tmp_path, lines)
    assert isinstance(first, InputRow)
    spec = parse_row(first, reader.source, reader.passthrough_schema, reader.passthrough_names)
    assert spec.tools == [
        {
            "type": "function",
            "function": {"name": "f", "description": None, "parameters": {"type": "object"}},
            "strict": True,
        }
    ]
    assert spec.tools is not None and list(spec.tools[0]) == ["type", "function", "strict"]
    assert list(spec.tools[0]["function"]) == ["name", "description", "parameters"]
    messages = ["item 0: function 'name' must be a string, got 5", "item 0: function 'name' is missing"]
    for line, (item, message) in enumerate(zip(bad, messages, strict=True), start=2):
        assert isinstance(item, InputRow)
        with pytest.raises(RowError) as raised:
            parse_row(item, reader.source, reader.passthrough_schema, reader.passthrough_names)
        assert (raised.value.line, raised.value.field, raised.value.message) == (line, "body.tools", message)


@pytest.mark.parametrize(
    ("line", "field", "says"),
    [
        (request("a", chat(tool_choice="required")), "body.tool_choice", "not supported"),
        (request("a", chat(tools='[{"function": {"name": "f"}}]')), "body.tools", "got a string (JSON text)"),
        (
            request("a", chat(tool_choice={"type": "function", "function": {"name": "f"}})),
            "body.tool_choice",
            "not supported",
        ),
        (
            request("a", {"model": "m", "prompt": "x", "tools": [{"type": "function"}]}, COMPLETIONS),
            "body.tools",
            "not a field of /v1/completions requests",
        ),
        (request("a", chat(stream=True)), "body.stream", "not supported"),
        (request("a", chat(audio={"voice": "x"})), "body.audio", "not supported"),
        (request("a", chat(modalities=["text", "audio"])), "body.modalities", "not supported"),
        (request("a", chat(reasoning_effort="low")), "body.reasoning_effort", "not supported"),
        (request("a", chat(echo=True)), "body.echo", "not supported"),
        (
            request("a", {"model": "m", "prompt": "x", "continue_final_message": True}, COMPLETIONS),
            "body.continue_final_message",
            "not a field of /v1/completions requests",
        ),
        (request("a", chat(prompt="x")), "body.prompt", "not a field of /v1/chat/completions"),
        (request("a", {"model": "m", "prompt": "x", "echo": True}, COMPLETIONS), "body.echo", "not supported"),
        (request("a", {"model": "m", "prompt": "x", "suffix": "y"}, COMPLETIONS), "body.suffix", "not supported"),
        (request("a", {"model": "m", "prompt": "x", "best_of": 3}, COMPLETIONS), "body.best_of", "equal to n"),
        (request("a", {"model": "m", "prompt": ["x", "y"]}, COMPLETIONS), "body.prompt", "holds 2 prompts"),
        (request("a", {"model": "m", "prompt": "x", "logprobs": "3"}, COMPLETIONS), "body.logprobs", "integer"),
        # What vLLM's lines may ask that batchgen's lines have no place for: the refusal says where it is (helper 109).
        (request("a", {"model": "m", "prompt": "x", "prompt_logprobs": 1}, COMPLETIONS), "body.prompt_logprobs", "row"),
        (request("a", {"model": "m", "prompt": "x", "echo": True}, COMPLETIONS), "body.echo", "to score a prompt"),
        (request("a", chat(return_token_ids=True)), "body.return_token_ids", "output_token_ids"),
        (request("a", {"model": "m", "input": "x"}, "/v1/embeddings"), "url", "/v1/embeddings"),
        (request("a", chat(), method="GET"), "method", '"GET"'),
        (request("a", chat(), extra=1), "extra", "not a field of an OpenAI Batch request line"),
        (
            request("a", chat(response_format={"type": "json_schema", "json_schema": {}})),
            "body.response_format",
            "schema",
        ),
        # Two constraints: the second named (vLLM's request model refuses two guided_* fields too).
        (
            request("a", chat(response_format={"type": "json_object"}, guided_regex="a+")),
            "body.guided_regex",
            "give one structured-output constraint (found: body.response_format, body.guided_regex)",
        ),
        (
            request("a", chat(structured_outputs={"regex": "a", "choice": ["a"]})),
            "body.structured_outputs.choice",
            "give one structured-output constraint",
        ),
        (request("a", chat(structured_outputs="a+")), "body.structured_outputs", "must be an object"),
        (
            request("a", chat(structured_outputs={"chioce": ["a"]})),
            "body.structured_outputs.chioce",
            "not a key batchgen reads (did you mean 'choice'?); leave it out",
        ),
        (
            request("a", chat(structured_outputs={"structural_tag": "{}"})),
            "body.structured_outputs.structural_tag",
            "is not supported by batchgen",
        ),
        (request("a", chat(structured_outputs={"json_object": 1})), "body.structured_outputs.json_object", "false"),
        (request("a", chat(guided_whitespace_pattern=" ")), "body.guided_whitespace_pattern", "leave it out"),
        (request("a", chat(guided_decoding={"regex": "a"})), "body.guided_decoding", "structured_outputs"),
        (request("a", chat(guided_decoding_backend="outlines")), "body.guided_decoding_backend", "not supported"),
        (request("a", {"model": "m"}), "body.messages", "required"),
        (request("a", "text"), "body", "must be an object"),
        ({"custom_id": 5, "method": "POST", "url": CHAT, "body": chat()}, "custom_id", "non-empty string"),
    ],
)
def test_a_line_asking_for_what_batchgen_cannot_do_is_an_error_row(
    tmp_path: Path, line: dict[str, Any], field: str, says: str
) -> None:
    first = request("first", {"prompt": "x"}, COMPLETIONS) if line["url"] == COMPLETIONS else request("first", chat())
    reader, (_, item) = read(tmp_path, [first, line])
    assert isinstance(item, InputRow) and item.problem is not None
    assert item.line == 2 and item.problem[0] == field and says in item.problem[1]
    with pytest.raises(RowError) as raised:
        parse_row(item, reader.source, reader.passthrough_schema, reader.passthrough_names)
    assert (raised.value.line, raised.value.field, raised.value.message) == (2, *item.problem)
    # The error row keeps the request's custom_id for its output line (a bad one as its id only).
    custom_id = line["custom_id"]
    expected = {"id": custom_id, "custom_id": custom_id} if isinstance(custom_id, str) else {"id": custom_id}
    assert item.data == expected


@pytest.mark.parametrize(
    ("body", "url", "message"),
    [
        # A typo gets the body field it most likely meant, among those of its endpoint.
        (chat(max_token=8), CHAT, "field 'body.max_token': not a field batchgen knows (did you mean 'max_tokens'?)"),
        (
            chat(top_log_probs=2),
            CHAT,
            "field 'body.top_log_probs': not a field batchgen knows (did you mean 'top_logprobs'?)",
        ),
        (
            {"prompt": "x", "temprature": 0},
            COMPLETIONS,
            "field 'body.temprature': not a field batchgen knows (did you mean 'temperature'?)",
        ),
        # Another API's field is not taken for a typo of one batchgen reads.
        (
            chat(reasoning_effort="low"),
            CHAT,
            "field 'body.reasoning_effort': not supported by batchgen; leave it out (the result would not be what it "
            "asks for)",
        ),
        (chat(prompt="x"), CHAT, "field 'body.prompt': not a field of /v1/chat/completions requests"),
    ],
)
def test_an_unknown_body_field_reads_as_one_clean_sentence(
    tmp_path: Path, body: dict[str, Any], url: str, message: str
) -> None:
    reader, (item,) = read(tmp_path, [request("a", body, url)])
    assert isinstance(item, InputRow)
    with pytest.raises(RowError) as raised:
        parse_row(item, reader.source, reader.passthrough_schema, reader.passthrough_names)
    assert str(raised.value) == f"{reader.source}:1: {message}"


@pytest.mark.parametrize("stream", [None, False])
def test_stream_options_without_stream_ask_for_nothing(tmp_path: Path, stream: bool | None) -> None:
    # As vLLM writes it; it applies only to stream: true.
    (row,) = rows(tmp_path, [request("a", chat(stream=stream, stream_options={"include_usage": True}))])
    assert row.problem is None and "stream_options" not in row.data


def test_stream_options_with_stream_names_stream(tmp_path: Path) -> None:
    _, (item,) = read(tmp_path, [request("a", chat(stream_options={"include_usage": True}, stream=True))])
    assert isinstance(item, InputRow) and item.problem == (
        "body.stream",
        "true is not supported by batchgen; leave it out (or give false)",
    )


def test_row_fields_are_named_by_the_request_fields_they_came_from(tmp_path: Path) -> None:
    (chat_row,) = rows(tmp_path, [request("a", chat(max_tokens=3, min_tokens=1, top_logprobs=2))])
    assert chat_row.columns["id"] == "custom_id"
    assert [chat_row.columns[name] for name in ("max_tokens", "min_new_tokens", "top_logprobs", "messages", "n")] == [
        "body.max_tokens",
        "body.min_tokens",
        "body.top_logprobs",
        "body.messages",
        "body.n",
    ]
    (completion,) = rows(tmp_path, [request("a", {"prompt": [1, 2], "logprobs": 2}, COMPLETIONS)])
    assert [completion.columns[name] for name in ("prompt_token_ids", "logprobs", "top_logprobs")] == [
        "body.prompt",
        "body.logprobs",
        "body.logprobs",  # a completions request's logprobs count is batchgen's top_logprobs
    ]
    assert chat_row.columns["json_schema"] == "body.response_format"
    (guided, structured) = rows(
        tmp_path, [request("g", chat(guided_json={})), request("s", chat(structured_outputs={"choice": ["x"]}))]
    )
    assert guided.columns["json_schema"] == "body.guided_json"
    assert structured.columns["choice"] == "body.structured_outputs.choice"


def test_a_custom_id_that_is_not_a_string_is_kept_as_given(tmp_path: Path) -> None:
    lines = [request("a", chat()), {**request("x", chat()), "custom_id": 5}, {**request("y", chat()), "custom_id": ""}]
    reader, (_, number, blank) = read(tmp_path, lines)
    assert isinstance(number, InputRow) and number.problem == ("custom_id", "must be a non-empty string, got 5")
    assert isinstance(blank, InputRow) and blank.problem is not None
    assert number.data == {"id": 5} and blank.data == {"id": ""}
    # Keyed by the id of its error row: the custom_id as JSON text, as for a batchgen row with a bad id.
    assert reader.openai is not None and reader.openai.given_ids == {"5": 5, '""': ""}


def test_one_endpoint_per_file(tmp_path: Path) -> None:
    reader, (_, second) = read(tmp_path, [request("a", chat()), request("b", {"prompt": "x"}, COMPLETIONS)])
    assert isinstance(second, InputRow) and second.problem is not None and second.problem[0] == "url"
    assert "one endpoint per file" in second.problem[1]


def test_the_first_bad_line_does_not_decide_the_endpoint(tmp_path: Path) -> None:
    reader, items = read(tmp_path, [request("a", {}, "/v1/embeddings"), request("b", {"prompt": "x"}, COMPLETIONS)])
    assert reader.openai is not None and reader.openai.url == COMPLETIONS
    assert isinstance(items[1], InputRow) and items[1].problem is None


def test_a_batchgen_row_in_an_openai_file_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(BatchgenError, match=r"requests\.jsonl:2: not an OpenAI Batch request line"):
        read(tmp_path, [request("a", chat()), {"prompt": "x"}])


def test_an_openai_line_in_a_batchgen_file_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(BatchgenError, match=r"requests\.jsonl:3: an OpenAI Batch request line, but the file's first"):
        read(tmp_path, [{"prompt": "x"}, {"prompt": "y"}, request("a", chat())])


def test_bad_json_before_the_first_request_does_not_decide_the_kind(tmp_path: Path) -> None:
    reader, items = read(tmp_path, ["{not json", request("a", chat())])
    assert isinstance(items[0], RowError) and reader.openai is not None


def test_a_datasets_own_url_body_and_method_columns_are_no_request_lines(tmp_path: Path) -> None:
    """OpenAI Batch lines have an object body (its API reference), and column options describe a dataset's own
    columns: such datasets are batchgen rows, their url, body, method and custom_id passed through (helper 64)."""
    pages = [{"url": "/v1/docs/intro", "body": "Once upon a time", "method": "POST", "title": "Intro"}]
    assert rows(tmp_path, pages)[0].data == pages[0]
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/users", "body": {"n": 1}}) + "\n")
    for option in ({"prompt_column": "url"}, {"prompt_template": "{method} {url}"}, {"id_column": "custom_id"}):
        reader = RowReader(path, options=InputOptions(**option))
        assert reader.openai is None and [item.data["url"] for item in reader if isinstance(item, InputRow)] == [
            "/v1/users"
        ]


def test_a_different_model_is_warned_about_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [request("a", chat(model="org/tiny")), request("b", chat(model="gpt-4o")), request("c", chat(model="o3"))]
    reader, _ = read(tmp_path, lines)
    assert reader.openai is not None
    reader.openai.expect_model("/models/tiny/")  # org/tiny is the same model, by its last path part
    reader.openai.expect_model("other")
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "requests.jsonl:2: body.model 'gpt-4o' is not the loaded model" in err


def test_the_loaded_model_by_another_path_is_no_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [
        request("a", chat(model="org/tiny")),
        request("b", chat(model="tiny")),
        request("c", chat(model="Org/Tiny")),
    ]
    reader, _ = read(tmp_path, lines)
    assert reader.openai is not None
    reader.openai.expect_model("/models/tiny/")  # hub ids keep capitals that model directories drop
    assert capsys.readouterr().err == ""


def test_output_format_choice(tmp_path: Path) -> None:
    _, _ = read(tmp_path, [request("a", chat())])
    openai = RowReader(tmp_path / "requests.jsonl").openai
    assert wants_openai_output("auto", openai, Path("o.jsonl"))
    assert not wants_openai_output("auto", openai, Path("o.arrow"))
    assert not wants_openai_output("auto", None, Path("o.jsonl"))
    assert not wants_openai_output("batchgen", openai, Path("o.jsonl"))
    with pytest.raises(BatchgenError, match="give --out a .jsonl path"):
        wants_openai_output("openai", openai, Path("o.parquet"))
    with pytest.raises(BatchgenError, match="needs an OpenAI Batch input"):
        wants_openai_output("openai", None, Path("o.jsonl"))
    # Neither fits: the input is named first, since no output path makes OpenAI lines of a plain input.
    with pytest.raises(BatchgenError, match="needs an OpenAI Batch input"):
        wants_openai_output("openai", None, Path("o.arrow"))


def test_status_counts_an_openai_output_line_by_its_custom_id() -> None:
    ok = {"id": "batch_req_1", "custom_id": "a", "response": {"status_code": 200, "body": {}}, "error": None}
    bad = {"id": "batch_req_2", "custom_id": "b", "response": {"status_code": 400, "body": {}}, "error": None}
    assert result_fields(ok) == {"id": "a", "sample_index": 0, "finish_reason": "done"}
    assert result_fields(bad)["finish_reason"] == "error"
    plain = {"id": "r", "sample_index": 1, "finish_reason": "stop"}
    assert result_fields(plain) is plain
    # A batchgen row that passes its input's custom_id and response through is still a batchgen row (found by a
    # helper: its status counted it as an OpenAI line, "finished with rows missing").
    passed = {**plain, "custom_id": "old-1", "response": {"status_code": 500}}
    assert result_fields(passed) is passed


@pytest.mark.parametrize(
    ("finish_reason", "matched_stop", "ids", "stop_reason"),
    [
        ("stop", "2", [7, 9, 2], None),  # the tokenizer's EOS: vLLM's None
        ("stop", "5", [7, 9, 5], 5),  # a stop token id: the id, an int
        ("stop", "2", [7, 9, 11], "2"),  # the stop string "2", which the tokens' text ends with
        ("stop", "\n\n", [7, 9, 11], "\n\n"),
        ("length", None, [7, 9, 11], None),
    ],
)
def test_a_choices_stop_reason_is_vllms(
    finish_reason: str, matched_stop: str | None, ids: list[int], stop_reason: int | str | None
) -> None:
    """vLLM's CompletionOutput.stop_reason, in the choices of the OpenAI Batch lines (found by a vLLM user: absent;
    batchgen's matched_stop column says "2" for EOS id 2 and for the stop string "2" alike)."""
    from types import SimpleNamespace

    from batchgen.io.openai_output import OpenAIOutput

    output = OpenAIOutput(Path("requests.jsonl"), None, "m", SimpleNamespace(eos_token_id=2), 0)  # type: ignore[arg-type]
    row = {"finish_reason": finish_reason, "matched_stop": matched_stop, "output_token_ids": ids}
    assert output._stop_reason(row) == stop_reason
