"""Chat rows with tool calls and tools: rendered by the chat template as vLLM's chat endpoint renders them (the
arguments of an assistant's tool calls parsed into objects, a tool-calling turn's null content as ""), and bad ones
refused in one line naming the message."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from batchgen.errors import RowError
from batchgen.io.input_row import InputRow
from batchgen.io.json_text import JSON_TEXT_METADATA
from batchgen.io.rows import parse_row
from batchgen.job.request_builder import RequestBuilder
from batchgen.sampling.sampling_params import SamplingParams
from tests.helpers.chat import CALL, HISTORY, TOOL_TEMPLATE, WEATHER
from tests.helpers.models import build_tokenizer


@pytest.fixture(scope="module")
def builder(tmp_path_factory: pytest.TempPathFactory) -> RequestBuilder:
    tokenizer = build_tokenizer(tmp_path_factory.mktemp("tok"))
    tokenizer.chat_template = TOOL_TEMPLATE
    return RequestBuilder(tokenizer, len(tokenizer), 4096, [1], SamplingParams(), run_seed=0)


# tools pass through too: as JSON text, the column of a field whose values share no type.
TOOLS_COLUMN = pa.schema([pa.field("tools", pa.string(), metadata=JSON_TEXT_METADATA)])


def spec_of(data: dict[str, Any], struct_nulls: bool = False) -> Any:
    row = InputRow(index=0, line=7, data=data, struct_nulls=struct_nulls)
    return parse_row(row, "in.jsonl", TOOLS_COLUMN, {"tools": "tools"})


def rendered(builder: RequestBuilder, data: dict[str, Any]) -> str:
    return str(builder.tokenizer.decode(builder.build(spec_of(data), "in.jsonl").prompt_ids))


def test_tool_calls_and_tools_render_as_vllm_gives_them_to_the_template(builder: RequestBuilder) -> None:
    """Hand-written expectation: the call's arguments are an object (``tojson`` prints JSON, not a quoted string),
    the calling turn's null content is empty, and the tools are printed as the row gives them."""
    text = rendered(builder, {"messages": HISTORY, "tools": [WEATHER]})
    assert text == (
        '[tools]{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}};\n'
        "[user]Weather in Paris?\n"
        '[assistant]<call c1>weather {"city": "Paris"}</call>\n'
        "[tool]18 C<for c1>\n"
        "[assistant]"
    )
    # Tools as JSON text (a Parquet column's), arguments already an object, or empty: the same template input.
    as_text = rendered(builder, {"messages": HISTORY, "tools": json.dumps([WEATHER])})
    assert as_text == text
    parsed = [HISTORY[0], {**HISTORY[1], "tool_calls": [{**CALL, "function": {"name": "weather", "arguments": {
        "city": "Paris"}}}]}, HISTORY[2]]  # fmt: skip
    assert rendered(builder, {"messages": parsed, "tools": [WEATHER]}) == text
    empty = [{**HISTORY[1], "tool_calls": [{**CALL, "function": {"name": "weather", "arguments": ""}}]}]
    assert "<call c1>weather {}</call>" in rendered(builder, {"messages": [HISTORY[0], *empty]})


def test_an_empty_tool_calls_list_is_no_calls(builder: RequestBuilder) -> None:
    """vLLM drops an empty tool_calls list, so that the template takes its plain assistant path."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes", "tool_calls": []}]
    messages.append({"role": "user", "content": "more"})
    assert rendered(builder, {"messages": messages}) == "[user]hi\n[assistant]yes\n[user]more\n[assistant]"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {
                "messages": [
                    HISTORY[0],
                    {
                        **HISTORY[1],
                        "tool_calls": [{**CALL, "function": {"name": "weather", "arguments": "{city: Paris}"}}],
                    },
                ]
            },  # fmt: skip
            "field 'messages': item 1: tool_calls[0]: function 'arguments' is not JSON (Expecting property name "
            "enclosed in double quotes: line 1 column 2 (char 1))",
        ),
        (
            {
                "messages": [
                    HISTORY[0],
                    {**HISTORY[1], "tool_calls": [{**CALL, "function": {"name": "weather", "arguments": "[1]"}}]},
                ]
            },  # fmt: skip
            "field 'messages': item 1: tool_calls[0]: function 'arguments' must be a JSON object, got array",
        ),
        (
            {"messages": [{"role": "user", "content": "hi", "tool_calls": [CALL]}]},
            "field 'messages': item 0: 'tool_calls' belong to an assistant message, not to role \"user\"",
        ),
        (
            {"messages": [HISTORY[0], {"role": "assistant", "tool_calls": [{"type": "code", "code": "x"}]}]},
            'field \'messages\': item 1: tool_calls[0] must be a function call: {"type": "function", "function": '
            "{...}}",
        ),
        (
            {"messages": [{"role": "user", "content": None}]},
            "field 'messages': item 0: 'content' must be a string, got null",
        ),
        (
            {"messages": [HISTORY[0], {"role": "assistant", "content": "x", "annotations": [{"type": "url"}]}]},
            "field 'messages': item 1: 'annotations' must be a string, got array",
        ),
        (
            {"messages": HISTORY, "tools": {"weather": 1}},
            "field 'tools': must be an array of function definitions, got object",
        ),  # fmt: skip
        (
            {"messages": HISTORY, "tools": "[{"},
            "field 'tools': is a string but not JSON (Expecting property name "
            "enclosed in double quotes: line 1 column 3 (char 2))",
        ),  # fmt: skip
        (
            {"messages": HISTORY, "tools": [{"type": "function", "function": {"name": 5}}]},
            "field 'tools': item 0: function 'name' must be a string, got 5",
        ),  # fmt: skip
        (
            {"messages": HISTORY, "tools": [{"type": "function", "function": {"description": "d"}}]},
            "field 'tools': item 0: function 'name' is missing",
        ),
        (
            {"messages": [HISTORY[0], {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
            "field 'messages': item 1: tool_calls[0]: function 'name' is missing",
        ),
    ],
)
def test_a_bad_tool_call_or_tool_is_one_line_naming_it(data: dict[str, Any], message: str) -> None:
    with pytest.raises(RowError) as caught:
        spec_of(data)
    assert str(caught.value) == f"in.jsonl:7: {message}"


def test_tools_under_a_template_that_does_not_render_them_are_left_out(tmp_path: Path) -> None:
    """As in vLLM and transformers: the template decides; the prompt is the one without tools."""
    tokenizer = build_tokenizer(tmp_path)
    tokenizer.chat_template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ '\\n' }}{% endfor %}[assistant]"
    builder = RequestBuilder(tokenizer, len(tokenizer), 4096, [1], SamplingParams(), run_seed=0)
    assert rendered(builder, {"messages": HISTORY[:1], "tools": [WEATHER]}) == "[user]Weather in Paris?\n[assistant]"


def test_what_vllm_takes_besides_runs_as_vllm_renders_it(builder: RequestBuilder) -> None:
    """An OpenAI SDK message dump (refusal null, annotations []), an assistant's null content without calls, tools
    given as "" or null (a Parquet column's none) or as bare function definitions (xLAM's), and a prompt row's tools
    (data: passed through, its prompt not a template's)."""
    dump = {"role": "assistant", "content": None, "refusal": None, "annotations": [], "audio": None}
    messages = [HISTORY[0], dump, {"role": "user", "content": "And?"}]
    assert rendered(builder, {"messages": messages}) == "[user]Weather in Paris?\n[assistant]\n[user]And?\n[assistant]"
    for none in ("", " ", None, "null", []):
        assert rendered(builder, {"messages": HISTORY[:1], "tools": none}) == "[user]Weather in Paris?\n[assistant]"
    bare = WEATHER["function"]
    assert rendered(builder, {"messages": HISTORY[:1], "tools": [bare]}) == (
        '[tools]{"name": "weather", "parameters": {"type": "object"}};\n[user]Weather in Paris?\n[assistant]'
    )
    spec = spec_of({"prompt": "hi", "tools": [bare]})
    assert spec.tools is None and json.loads(spec.passthrough["tools"]) == [bare]


def test_tools_of_the_chat_template_arguments_render_unless_the_row_gives_its_own(tmp_path: Path) -> None:
    """vLLM applies chat_template_kwargs over its tools argument; batchgen's row field is the more specific one."""
    tokenizer = build_tokenizer(tmp_path)
    tokenizer.chat_template = TOOL_TEMPLATE
    other = {"type": "function", "function": {"name": "time"}}
    run = RequestBuilder(
        tokenizer, len(tokenizer), 4096, [1], SamplingParams(), run_seed=0,
        chat_template_kwargs={"tools": [other]},
    )  # fmt: skip
    assert rendered(run, {"messages": HISTORY[:1]}).startswith(
        '[tools]{"type": "function", "function": {"name": "time"}};'
    )
    assert rendered(run, {"messages": HISTORY[:1], "tools": [WEATHER]}).startswith(
        '[tools]{"type": "function", "function": {"name": "weather"'
    )
    row = {"messages": HISTORY[:1], "chat_template_kwargs": {"tools": [WEATHER]}}
    assert rendered(run, row).startswith('[tools]{"type": "function", "function": {"name": "weather"')


def test_a_struct_rows_null_filling_is_left_out_of_tool_calls_and_tools() -> None:
    """Parquet and Arrow give every struct of a column every key: a call's arguments and a tool's schema are the
    row's own without the nulls (a JSON row's nulls are its own)."""
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris", "tz": None}}}
    tool = {"type": "function", "function": {"name": "weather", "description": None, "parameters": {"type": "object",
        "required": None}}}  # fmt: skip
    data = {"messages": [HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [call]}], "tools": [tool]}
    for struct_nulls, kept in ((True, False), (False, True)):
        spec = spec_of(data, struct_nulls)
        assert spec.messages is not None and spec.tools is not None
        assert ("tz" in spec.messages[1]["tool_calls"][0]["function"]["arguments"]) == kept
        assert ("required" in spec.tools[0]["function"]["parameters"]) == kept
        assert ("description" in spec.tools[0]["function"]) == kept
