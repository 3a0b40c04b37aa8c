"""Conversations with tool calls through ``batchgen run``: an OpenAI Batch file's chat requests with ``tools`` and a
tool-calling history, and a Parquet dataset whose messages are structs, prompt the model with what Hugging Face's
``apply_chat_template`` renders from the messages and tools as vLLM hands them to it (the reference)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.helpers.chat import CALL, HISTORY, TOOL_TEMPLATE, WEATHER, with_chat_template
from tests.helpers.cli import read_rows, run_args, run_cli, write_jsonl

# What vLLM gives the template (vllm/entrypoints/chat_utils.py, _postprocess_messages; protocol.py's tool model):
# the arguments parsed, the calling turn's content empty, the tool with its declared fields.
AS_VLLM_GIVES_THEM = [
    HISTORY[0],
    {"role": "assistant", "content": "", "tool_calls": [{**CALL, "function": {"name": "weather", "arguments": {
        "city": "Paris"}}}]},
    HISTORY[2],
]  # fmt: skip
VLLM_TOOL = {"type": "function", "function": {"name": "weather", "description": None, "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def model(random_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random llama with a tool-use chat template."""
    return with_chat_template(random_models["llama"], TOOL_TEMPLATE, tmp_path_factory.mktemp("tools") / "llama")


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model)


def prompt_length(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: Any = None) -> int:
    rendered = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_dict=True)
    return len(rendered["input_ids"])


def test_an_openai_batch_line_with_tools_and_tool_calls(
    model: Path, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    body = {"model": "m", "messages": HISTORY, "tools": [WEATHER], "tool_choice": "auto", "max_tokens": 2}
    plain = {"model": "m", "messages": HISTORY[:1], "tools": [], "tool_choice": "none", "max_tokens": 2}
    lines = [
        {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": b}
        for cid, b in (("t", body), ("p", plain))
    ]
    dataset = write_jsonl(tmp_path / "requests.jsonl", lines)
    code, output = run_cli(run_args(dataset, tmp_path / "out.jsonl", model))
    assert code == 0, output
    got = {line["custom_id"]: line for line in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    usage = {cid: line["response"]["body"]["usage"]["prompt_tokens"] for cid, line in got.items()}
    assert usage == {
        "t": prompt_length(tokenizer, AS_VLLM_GIVES_THEM, [VLLM_TOOL]),
        "p": prompt_length(tokenizer, HISTORY[:1]),
    }
    # The reference does depend on both: a check that could not fail otherwise.
    assert usage["t"] != prompt_length(tokenizer, AS_VLLM_GIVES_THEM) != prompt_length(tokenizer, HISTORY, [VLLM_TOOL])


def test_a_parquet_dataset_of_tool_calling_conversations(
    model: Path, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    """Parquet keeps messages as structs: every message holds every key (null where it had none), and tools as the
    JSON text datasets often keep them in."""
    rows = [
        {"id": "t", "messages": HISTORY, "tools": json.dumps([VLLM_TOOL])},
        {"id": "p", "messages": HISTORY[:1], "tools": None},
    ]
    dataset = tmp_path / "conversations.parquet"
    pq.write_table(pa.Table.from_pylist(rows), dataset)
    code, output = run_cli([*run_args(dataset, tmp_path / "out.arrow", model), "--max-new-tokens", "2"])
    assert code == 0, output
    usage = {rid: row["prompt_tokens"] for rid, row in read_rows(tmp_path / "out.arrow").items()}
    assert usage == {
        "t": prompt_length(tokenizer, AS_VLLM_GIVES_THEM, [VLLM_TOOL]),
        "p": prompt_length(tokenizer, HISTORY[:1]),
    }

    # Arguments and tools as structs (a HF dataset's): each struct holds the keys of the others, null, which the
    # template would print (found by a helper); the prompts are those of each row's own objects.
    def conversation(name: str, arguments: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
        call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}
        messages = [HISTORY[0], {"role": "assistant", "content": "", "tool_calls": [call]}]
        return {"id": name, "messages": messages, "tools": [{"type": "function", "function": {"name": name,
            "parameters": schema}}]}  # fmt: skip

    rows = [
        conversation("weather", {"city": "Paris"}, {"type": "object", "properties": {"city": {"type": "string"}}}),
        conversation("time", {"tz": "CET"}, {"type": "object", "required": ["tz"]}),
    ]
    pq.write_table(pa.Table.from_pylist(rows), dataset)
    want = {row["id"]: prompt_length(tokenizer, row["messages"], row["tools"]) for row in rows}
    # Column options map the rows anew: they stay struct rows (found by a helper).
    for options in ([], ["--id-column", "id"]):
        code, output = run_cli([*run_args(dataset, tmp_path / "out.arrow", model), "--max-new-tokens", "2", *options])
        assert code == 0, output
        assert {rid: row["prompt_tokens"] for rid, row in read_rows(tmp_path / "out.arrow").items()} == want


def test_tools_a_chat_template_does_not_render_are_named_once(
    random_models: dict[str, Path], model: Path, tmp_path: Path
) -> None:
    """The template decides, as in vLLM: tools it does not mention are not in the prompt, which one warning says,
    naming the first row that gives them and how many more do."""
    plain = with_chat_template(
        random_models["llama"], "{% for m in messages %}{{ m.content }}{% endfor %}", tmp_path / "m"
    )
    rows = [{"id": str(i), "messages": HISTORY[:1], "tools": [WEATHER], "max_new_tokens": 1} for i in range(3)]
    dataset = write_jsonl(tmp_path / "rows.jsonl", [{"id": "x", "prompt": "hi", "max_new_tokens": 1}, *rows])
    code, output = run_cli(run_args(dataset, tmp_path / "out.arrow", plain))
    assert code == 0, output
    warning = (
        f"batchgen: warning: {dataset}:2 and 2 more rows: field 'tools': the model's chat template does not render "
        "tools, so they are not in these rows' prompts (as in vLLM); use a model whose template does"
    )
    assert output.splitlines().count(warning) == 1, output
    code, output = run_cli(run_args(dataset, tmp_path / "out.arrow", model))
    assert code == 0 and "warning" not in output, output


def test_sharegpt_items_keep_their_tool_calls(model: Path, tokenizer: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    """A ShareGPT item's keys other than from and value stay on the message it becomes (found by a helper: the call
    and the tool message's id were dropped)."""
    conversation = [
        {"from": "human", "value": HISTORY[0]["content"]},
        {"from": "gpt", "value": "", "tool_calls": [CALL]},
        {"from": "tool", "value": "18 C", "tool_call_id": "c1"},
    ]
    dataset = write_jsonl(tmp_path / "sharegpt.jsonl", [{"id": "s", "conversations": conversation, "tools": [WEATHER]}])
    code, output = run_cli(run_args(dataset, tmp_path / "out.arrow", model))
    assert code == 0, output
    assert read_rows(tmp_path / "out.arrow")["s"]["prompt_tokens"] == prompt_length(
        tokenizer, AS_VLLM_GIVES_THEM, [WEATHER]
    )


def test_tools_pass_through_where_they_are_data(
    model: Path, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    """A dataset of prompts keeps its tools as data (xLAM's query, tools and answers): they pass through, as every
    field did before batchgen read tools, and no warning says a template does not render them; a ShareGPT item's
    trainer fields (axolotl's weight) are not message text, and are left out as before (found by a helper)."""
    xlam = [{"id": "x", "query": "Weather in Paris?", "tools": json.dumps([WEATHER["function"]]), "answers": "[]"}]
    dataset = write_jsonl(tmp_path / "xlam.jsonl", xlam)
    flags = ["--prompt-template", "Tools: {tools}\nQ: {query}\nA:"]
    plain = with_chat_template(model, "{% for m in messages %}{{ m.content }}{% endfor %}", tmp_path / "plain")
    code, output = run_cli([*run_args(dataset, tmp_path / "out.arrow", plain), *flags])
    assert code == 0 and "warning" not in output, output
    assert read_rows(tmp_path / "out.arrow")["x"]["tools"] == xlam[0]["tools"]
    conversation = [{"from": "human", "value": "Hi", "weight": 0}, {"from": "gpt", "value": "Yes", "train": False}]
    conversation.append({"from": "human", "value": "More"})
    dataset = write_jsonl(tmp_path / "sharegpt.jsonl", [{"id": "s", "conversations": conversation}])
    code, output = run_cli(run_args(dataset, tmp_path / "out.arrow", model))
    assert code == 0, output
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yes"},
        {"role": "user", "content": "More"},
    ]
    assert read_rows(tmp_path / "out.arrow")["s"]["prompt_tokens"] == prompt_length(tokenizer, messages)


def test_an_openai_files_tools_stay_out_of_its_arrow_output(model: Path, tmp_path: Path) -> None:
    """A request's tools are the request's, not data: the one column an OpenAI file adds is custom_id."""
    other = {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "required": ["tz"]}}}
    lines = [
        {"custom_id": str(i), "method": "POST", "url": "/v1/chat/completions", "body": {"messages": HISTORY[:1],
            "tools": tools, "max_tokens": 1}}
        for i, tools in enumerate(([WEATHER], [other, WEATHER]))
    ]  # fmt: skip
    dataset = write_jsonl(tmp_path / "requests.jsonl", lines)
    code, output = run_cli(run_args(dataset, tmp_path / "out.arrow", model))
    assert code == 0 and "warning" not in output, output
    assert "tools" not in next(iter(read_rows(tmp_path / "out.arrow").values()))


def test_the_python_api_renders_a_rows_tools(model: Path, tokenizer: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    """Rows given in Python, pandas' records of a Parquet file among them (numpy arrays for lists, struct nulls):
    each row's tools reach its template, over the call's chat_template_kwargs' (found by a helper: none did)."""
    import pandas as pd

    import batchgen

    generator = batchgen.Generator(str(model), dtype="float32", device="cpu", max_running_requests=2)
    other = {"type": "function", "function": {"name": "time"}}
    rows = [
        {"id": "list", "messages": HISTORY[:1], "tools": [WEATHER]},
        {"id": "text", "messages": HISTORY[:1], "tools": json.dumps([WEATHER])},
        {"id": "call", "messages": HISTORY[:1]},
    ]
    got = {r["id"]: r["prompt_tokens"] for r in generator.generate(rows, max_new_tokens=1, chat_template_kwargs={
        "tools": [other]})}  # fmt: skip
    assert got == {
        "list": prompt_length(tokenizer, HISTORY[:1], [WEATHER]),
        "text": prompt_length(tokenizer, HISTORY[:1], [WEATHER]),
        "call": prompt_length(tokenizer, HISTORY[:1], [other]),
    }
    pq.write_table(
        pa.Table.from_pylist([{"id": "p", "messages": HISTORY[:1], "tools": [WEATHER]}]), tmp_path / "t.parquet"
    )
    records = pd.read_parquet(tmp_path / "t.parquet").to_dict("records")
    (row,) = generator.generate(records, max_new_tokens=1)
    assert row["prompt_tokens"] == prompt_length(tokenizer, HISTORY[:1], [WEATHER])
    # A ShareGPT conversations column read so (a numpy array) crashed the call (found by a helper).
    sharegpt = [{"id": "s", "conversations": [{"from": "human", "value": HISTORY[0]["content"]}]}]
    pq.write_table(pa.Table.from_pylist(sharegpt), tmp_path / "s.parquet")
    (row,) = generator.generate(pd.read_parquet(tmp_path / "s.parquet").to_dict("records"), max_new_tokens=1)
    assert row["prompt_tokens"] == prompt_length(tokenizer, HISTORY[:1])
