"""Bad input: every bad row gives one line ``batchgen: error: <file>:<line>: field '<field>': <message>``, the good
rows of the same file are still generated (and equal a clean run of each alone), and the run exits 2; with
``--on-error skip`` the bad rows are written with ``finish_reason == "error"``; file-level problems exit 2 at once
with one line; no traceback anywhere."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io.partial_output import partial_dir
from batchgen.io.writer import read_results
from tests.helpers.cli import run_cli, write_jsonl

# Two good rows around the bad one. ignore_eos pins completion_tokens to max_new_tokens.
GOOD_1 = {"id": "g1", "prompt": "Once upon a time", "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
GOOD_2 = {
    "id": "g2",
    "prompt_token_ids": [0, 45, 71, 80],
    "max_new_tokens": 4,
    "temperature": 0,
    "ignore_eos": True,
    "top_logprobs": 2,
}
GOOD = {"g1": GOOD_1, "g2": GOOD_2}
BAD_LINE = 3  # line 1: GOOD_1, line 2: blank, line 3: the bad row, line 4: GOOD_2
VOCAB = 400  # the conftest test tokenizer: 256 bytes + merges + <s>, </s>
CONTEXT = ["--context-length", "16"]
FITS = " (truncate_prompt_tokens -1 keeps the last that fit)"  # the hint of a prompt past the context
COMMON = ["--dtype", "float32", "--device", "cpu", "--no-progress"]
LEFT_OUT_1 = (
    "batchgen: error: 1 bad input row left out (see above; --on-error skip writes them); once they are fixed, --resume "
    "adds them"
)
SUMMARY = re.compile(
    r"^batchgen: (\d+) rows?(?: \(\d+ samples\))? done, (\d+) bad rows?, (\d+) prompt \+ (\d+) output tokens in "
    r"[\d.]+ s, [\d.]+ output tok/s, (\d+) preemptions?(?:, prefix cache \d+ % of prompt tokens)?$"
)


@dataclass(frozen=True)
class Case:
    """One bad row: its line (a dict is JSON-encoded; str/bytes are written as they are), the field its error must
    name (None: the whole line is wrong), the exact message after ``field '<field>': ``, extra CLI flags, model."""

    row: dict[str, Any] | str | bytes
    field: str | None
    message: str
    args: tuple[str, ...] = ()
    model: str = "llama"


def _bad(**fields: Any) -> dict[str, Any]:
    return {"id": "bad", **fields}


_MSG = {"role": "user", "content": "hi"}
CASES: dict[str, Case] = {
    # --- not a JSON object
    "bad_json": Case(
        # An unquoted key (not a trailing comma: Python 3.13 words that error differently).
        '{"id": "bad", prompt: "x"}',
        None,
        "invalid JSON: Expecting property name enclosed in double quotes (column 15)",
    ),
    # The closing brace missing: the error points just past the 27 characters (column 28), not to a next line.
    "truncated_json": Case('{"id": "bad", "prompt": "x"', None, "invalid JSON: Expecting ',' delimiter (column 28)"),
    "json_array_line": Case('["x"]', None, "expected a JSON object, got array"),
    "invalid_utf8": Case(b'{"id": "bad", "prompt": "\xff"}', None, "invalid UTF-8 at byte 26"),
    # --- prompt fields
    "no_prompt": Case(
        _bad(max_new_tokens=3),
        "prompt",
        "row has no prompt: give one of prompt, messages, prompt_token_ids (found 'max_new_tokens')",
    ),
    # Another tool's name for the prompt: the message names the field it found and the rename (found by a new user).
    "text_instead_of_prompt": Case(
        _bad(text="x"),
        "prompt",
        "row has no prompt: give one of prompt, messages, prompt_token_ids (found 'text'; rename it to 'prompt' "
        "or pass --prompt-column text)",
    ),
    "input_ids_instead_of_prompt_token_ids": Case(
        _bad(topic="t", input_ids=[0, 5]),
        "prompt",
        "row has no prompt: give one of prompt, messages, prompt_token_ids (found 'topic', 'input_ids'; rename "
        "'input_ids' to 'prompt_token_ids')",
    ),
    "prompt_and_token_ids": Case(
        _bad(prompt="x", prompt_token_ids=[0, 5]),
        "prompt_token_ids",
        "give only one of prompt, messages, prompt_token_ids (found: prompt, prompt_token_ids)",
    ),
    "prompt_and_messages": Case(
        _bad(prompt="x", messages=[_MSG]),
        "messages",
        "give only one of prompt, messages, prompt_token_ids (found: prompt, messages)",
    ),
    # --- wrong types
    "prompt_not_string": Case(_bad(prompt=5), "prompt", "must be a string, got number"),
    "max_new_tokens_string": Case(
        _bad(prompt="x", max_new_tokens="10"), "max_new_tokens", 'must be an integer, got "10"'
    ),
    "temperature_string": Case(_bad(prompt="x", temperature="hot"), "temperature", 'must be a number, got "hot"'),
    "stop_number": Case(_bad(prompt="x", stop=5), "stop", "must be a string or a list of strings, got 5"),
    "stop_token_ids_string": Case(
        _bad(prompt="x", stop_token_ids="1"), "stop_token_ids", 'must be a list of integers, got "1"'
    ),
    "ignore_eos_string": Case(_bad(prompt="x", ignore_eos="yes"), "ignore_eos", 'must be true or false, got "yes"'),
    "logprobs_count": Case(
        _bad(prompt="x", logprobs=5),
        "logprobs",
        "must be true or false, got 5 (vLLM's logprobs=N is logprobs true with top_logprobs N)",
    ),
    "max_new_tokens_fraction": Case(
        _bad(prompt="x", max_new_tokens=4.5), "max_new_tokens", "must be an integer, got 4.5"
    ),
    "seed_fraction": Case(_bad(prompt="x", seed=0.5), "seed", "must be an integer or null, got 0.5"),
    # Values are shown as JSON, as the user wrote them (true, not Python's True).
    "max_new_tokens_bool": Case(
        _bad(prompt="x", max_new_tokens=True), "max_new_tokens", "must be an integer, got true"
    ),
    "id_list": Case({"id": [1], "prompt": "x"}, "id", "must be a string or an integer, got [1]"),
    "id_bool": Case({"id": True, "prompt": "x"}, "id", "must be a string or an integer, got true"),
    "id_empty": Case(
        {"id": "", "prompt": "x"}, "id", 'must not be empty or blank (leave "id" out for the row\'s index)'
    ),
    "id_lone_surrogate": Case(
        {"id": "\ud800", "prompt": "x"}, "id", "holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text"
    ),
    # It could never match: detokenized text never holds one.
    "stop_lone_surrogate": Case(
        _bad(prompt="x", stop=["ok", "a\udfff"]),
        "stop",
        "holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text",
    ),
    "messages_string": Case(
        _bad(messages="hi"), "messages", "must be a non-empty array of {role, content} objects, got string"
    ),
    "messages_empty": Case(
        _bad(messages=[]), "messages", "must be a non-empty array of {role, content} objects, got an empty array"
    ),
    "messages_item_not_object": Case(_bad(messages=["hi"]), "messages", "item 0 must be an object, got string"),
    "messages_item_no_content": Case(_bad(messages=[{"role": "user"}]), "messages", "item 0: 'content' is missing"),
    "chat_template_kwargs_not_object": Case(
        _bad(messages=[{"role": "user", "content": "hi"}], chat_template_kwargs=["x"]),
        "chat_template_kwargs",
        "must be an object of template arguments, got array",
    ),
    "chat_template_kwargs_without_messages": Case(
        _bad(prompt="x", chat_template_kwargs={"enable_thinking": False}),
        "chat_template_kwargs",
        "needs messages: a prompt is not rendered by the chat template",
    ),
    "chat_template_kwargs_batchgens_argument": Case(
        _bad(messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={"add_generation_prompt": False}),
        "chat_template_kwargs",
        "'add_generation_prompt' is a row field, not a template argument: give it beside messages, as vLLM's "
        "requests do",
    ),
    "prompt_token_ids_string_item": Case(
        _bad(prompt_token_ids=[0, "a"]), "prompt_token_ids", 'item 1 must be an integer, got "a"'
    ),
    # A number with no fraction is the integer, as in the integer fields (found by a vLLM user: 1.0 was refused).
    "prompt_token_ids_fraction": Case(
        _bad(prompt_token_ids=[1.0, 2.5]), "prompt_token_ids", "item 1 must be an integer, got 2.5"
    ),
    # --- out-of-range sampling values
    "temperature_negative": Case(
        _bad(prompt="x", temperature=-0.5), "temperature", "must be a number in [0, 10000], got -0.5"
    ),
    "top_p_zero": Case(_bad(prompt="x", top_p=0), "top_p", "must be in (0, 1], got 0.0"),
    "top_p_above_1": Case(_bad(prompt="x", top_p=1.5), "top_p", "must be in (0, 1], got 1.5"),
    "top_k_minus_2": Case(_bad(prompt="x", top_k=-2), "top_k", "must be -1 or 0 (off) or a positive count, got -2"),
    "min_p_above_1": Case(_bad(prompt="x", min_p=1.5), "min_p", "must be in [0, 1], got 1.5"),
    "max_new_tokens_negative": Case(_bad(prompt="x", max_new_tokens=-1), "max_new_tokens", "must be >= 0, got -1"),
    # OpenAI's names for max_new_tokens are read as it, and errors name the field the row gave.
    "max_tokens_negative": Case(_bad(prompt="x", max_tokens=-1), "max_tokens", "must be >= 0, got -1"),
    "max_completion_tokens_string": Case(
        _bad(prompt="x", max_completion_tokens="10"), "max_completion_tokens", 'must be an integer, got "10"'
    ),
    "max_tokens_and_max_new_tokens": Case(
        _bad(prompt="x", max_new_tokens=3, max_tokens=3),
        "max_tokens",
        "give only one of max_new_tokens, max_tokens, max_completion_tokens (found: max_new_tokens, max_tokens)",
    ),
    "min_new_tokens_above_max": Case(
        _bad(prompt="x", max_new_tokens=3, min_new_tokens=9), "min_new_tokens", "must be <= max_new_tokens (3), got 9"
    ),
    # vLLM's min_tokens is read as min_new_tokens (vLLM's SamplingParams: "minimum number of tokens to generate").
    "min_tokens_above_max": Case(
        _bad(prompt="x", max_new_tokens=3, min_tokens=9), "min_tokens", "must be <= max_new_tokens (3), got 9"
    ),
    "min_tokens_and_min_new_tokens": Case(
        _bad(prompt="x", min_new_tokens=1, min_tokens=1),
        "min_tokens",
        "give only one of min_new_tokens, min_tokens (found: min_new_tokens, min_tokens)",
    ),
    "seed_past_int64": Case(
        _bad(prompt="x", seed=2**63), "seed", f"must be a 64-bit signed integer, in [-2**63, 2**63), got {2**63}"
    ),
    "top_logprobs_above_vocab": Case(
        _bad(prompt="x", top_logprobs=VOCAB + 1), "top_logprobs", f"must be in [0, vocab size {VOCAB}], got {VOCAB + 1}"
    ),
    # --- token ids outside the vocabulary
    "prompt_token_id_vocab": Case(
        _bad(prompt_token_ids=[0, VOCAB]), "prompt_token_ids", f"id {VOCAB} is outside the vocabulary [0, {VOCAB})"
    ),
    "prompt_token_id_minus_1": Case(
        _bad(prompt_token_ids=[0, -1]), "prompt_token_ids", f"id -1 is outside the vocabulary [0, {VOCAB})"
    ),
    "stop_token_id_vocab": Case(
        _bad(prompt="x", stop_token_ids=[1, VOCAB]),
        "stop_token_ids",
        f"id {VOCAB} is outside the vocabulary [0, {VOCAB})",
    ),
    "stop_token_id_minus_1": Case(
        _bad(prompt="x", stop_token_ids=[-1]), "stop_token_ids", f"id -1 is outside the vocabulary [0, {VOCAB})"
    ),
    # --- empty prompts
    "prompt_token_ids_empty": Case(
        _bad(prompt_token_ids=[]), "prompt_token_ids", "must be a non-empty array of integers, got an empty array"
    ),
    "prompt_empty_without_bos": Case(_bad(prompt=""), "prompt", "prompt is empty after tokenization", model="nobos"),
    # --- prompt does not fit the context (16 tokens)
    "prompt_token_ids_at_context": Case(
        _bad(prompt_token_ids=[0] + [5] * 15),
        "prompt_token_ids",
        "prompt has 16 tokens, >= context length 16" + FITS,
        CONTEXT,
    ),
    # "~" is not in the tokenizer's training corpus: one token per byte, plus BOS.
    "prompt_text_over_context": Case(
        _bad(prompt="~" * 20), "prompt", "prompt has 21 tokens, >= context length 16" + FITS, CONTEXT
    ),
    # --- duplicate id: the first row with the id (GOOD_1) is generated, the second is the bad one
    "duplicate_id": Case({"id": "g1", "prompt": "The quick"}, "id", "duplicate id 'g1'"),
}


def _line_bytes(row: dict[str, Any] | str | bytes) -> bytes:
    if isinstance(row, bytes):
        return row
    return (row if isinstance(row, str) else json.dumps(row)).encode()


def _dataset(path: Path, bad: dict[str, Any] | str | bytes) -> Path:
    lines = [json.dumps(GOOD_1).encode(), b"", _line_bytes(bad), json.dumps(GOOD_2).encode()]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _run(dataset: Path, out: Path, model: Path | str, *extra: str) -> tuple[int, list[str]]:
    code, output = run_cli(["run", str(dataset), "--out", str(out), "--model", str(model), *COMMON, *extra])
    assert "Traceback" not in output, output
    return code, [line for line in output.splitlines() if line.strip()]


def _summary(lines: list[str]) -> tuple[int, ...]:
    matches = [m for m in map(SUMMARY.match, lines) if m]
    assert len(matches) == 1, lines
    return tuple(int(g) for g in matches[0].groups())


@pytest.fixture(scope="module")
def models(random_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``llama``: the tiny test model; ``nobos``: a copy whose tokenizer adds no BOS (so "" has no tokens)."""
    nobos = tmp_path_factory.mktemp("nobos") / "model"
    shutil.copytree(random_models["llama"], nobos)
    tokenizer_json = nobos / "tokenizer.json"
    data = json.loads(tokenizer_json.read_text())
    data["post_processor"] = None
    tokenizer_json.write_text(json.dumps(data))
    return {"llama": random_models["llama"], "nobos": nobos}


@pytest.fixture(scope="module")
def reference(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``reference(model, rid)``: the output row of good row ``rid`` run alone, in a clean file."""
    cache: dict[tuple[str, str], dict[str, Any]] = {}

    def get(model: str, rid: str) -> dict[str, Any]:
        if (model, rid) not in cache:
            work = tmp_path_factory.mktemp(f"ref-{model}-{rid}")
            dataset = write_jsonl(work / "in.jsonl", [GOOD[rid]])
            code, lines = _run(dataset, work / "out.arrow", models[model])
            assert code == 0, lines
            rows = read_results(work / "out.arrow").to_pylist()
            assert len(rows) == 1
            cache[(model, rid)] = rows[0]
        return cache[(model, rid)]

    return get


def _assert_same_generation(got: dict[str, Any], ref: dict[str, Any]) -> None:
    for key in ("id", "text", "output_token_ids", "finish_reason", "matched_stop", "error"):
        assert got[key] == ref[key], key
    for key in ("prompt_tokens", "completion_tokens"):
        assert got[key] == ref[key], key
    assert got["output_logprobs"] == pytest.approx(ref["output_logprobs"], abs=1e-5)
    if ref["top_logprobs"] is None:
        assert got["top_logprobs"] is None
    else:
        assert [[t["id"] for t in step] for step in got["top_logprobs"]] == [
            [t["id"] for t in step] for step in ref["top_logprobs"]
        ]
        assert [t["logprob"] for step in got["top_logprobs"] for t in step] == pytest.approx(
            [t["logprob"] for step in ref["top_logprobs"] for t in step], abs=1e-5
        )


def _check_good_rows(rows: list[dict[str, Any]], model: str, reference: Any) -> None:
    good = {r["id"]: r for r in rows if r["id"] in GOOD and r["finish_reason"] != "error"}
    assert sorted(good) == ["g1", "g2"]
    for rid, row in good.items():
        assert row["completion_tokens"] == GOOD[rid]["max_new_tokens"]
        assert row["finish_reason"] == "length"
        _assert_same_generation(row, reference(model, rid))
    assert good["g1"]["prompt_tokens"] == (6 if model == "llama" else 5)  # BOS + 5 text tokens
    assert good["g2"]["prompt_tokens"] == 4
    assert all(len(step) == 2 for step in good["g2"]["top_logprobs"])


def _expected_error(path: Path, case: Case) -> str:
    where = f"{path}:{BAD_LINE}"
    return f"{where}: field '{case.field}': {case.message}" if case.field else f"{where}: {case.message}"


# --- row-level errors, --on-error fail (the default) ------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_bad_row_is_reported_and_left_out(name: str, models: dict[str, Path], reference: Any, tmp_path: Path) -> None:
    case = CASES[name]
    dataset = _dataset(tmp_path / "in.jsonl", case.row)
    out = tmp_path / "out.arrow"
    code, lines = _run(dataset, out, models[case.model], *case.args)

    # (a) exit code 3, and the last line says how many bad rows were left out.
    assert code == 3, lines
    assert lines[-1] == LEFT_OUT_1
    # (b) exactly one error line for the row, naming file, line and field.
    errors = [line for line in lines if line.startswith("batchgen: error: ") and line != LEFT_OUT_1]
    assert errors == [f"batchgen: error: {_expected_error(dataset, case)}"]
    if case.field is not None:
        assert f"{dataset}:{BAD_LINE}: field '{case.field}'" in errors[0]
    else:
        assert f"{dataset}:{BAD_LINE}: " in errors[0] and "field '" not in errors[0]
    # (c) the good rows are all there and equal a clean run of each row alone.
    rows = read_results(out).to_pylist()
    _check_good_rows(rows, case.model, reference)
    # (d) the bad row is absent: only the two good rows were written.
    assert sorted(r["id"] for r in rows) == ["g1", "g2"]
    assert all(r["finish_reason"] == "length" and r["error"] is None for r in rows)
    # The summary counts only what was generated: the good rows' tokens.
    prompt_tokens = sum(r["prompt_tokens"] for r in rows)
    _requests, errors_count, prompt, output, _preemptions = _summary(lines)
    assert (errors_count, prompt, output) == (1, prompt_tokens, 6 + 4)


def test_many_bad_rows_print_the_first_20_then_count(models: dict[str, Path], tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = [GOOD_1] + [{"id": f"b{i}", "prompt": i} for i in range(25)] + [GOOD_2]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    code, lines = _run(dataset, tmp_path / "out.arrow", models["llama"])
    assert code == 3
    errors = [line for line in lines if line.startswith("batchgen: error: ")]
    assert errors[:20] == [
        f"batchgen: error: {dataset}:{i + 2}: field 'prompt': must be a string, got number" for i in range(20)
    ]
    assert errors[20:] == [
        "batchgen: error: more bad rows; only the first 20 are shown",
        "batchgen: error: 25 bad input rows left out (see above; --on-error skip writes them); once they are fixed, "
        "--resume adds them",
    ]
    assert sorted(r["id"] for r in read_results(tmp_path / "out.arrow").to_pylist()) == ["g1", "g2"]


def test_bad_parquet_row_names_its_row_number(models: dict[str, Path], reference: Any, tmp_path: Path) -> None:
    table = pa.table(
        {
            "id": ["g1", "bad", "g3"],
            "prompt": [GOOD_1["prompt"], "x", "The quick"],
            "max_new_tokens": [6, 6, 3],
            "temperature": [0.0, -1.0, 0.0],
            "ignore_eos": [True, True, True],
        }
    )
    dataset = tmp_path / "in.parquet"
    pq.write_table(table, dataset)
    out = tmp_path / "out.arrow"
    code, lines = _run(dataset, out, models["llama"])
    assert code == 3
    assert f"batchgen: error: {dataset}:2: field 'temperature': must be a number in [0, 10000], got -1.0" in lines
    assert lines[-1] == LEFT_OUT_1
    rows = {r["id"]: r for r in read_results(out).to_pylist()}
    assert sorted(rows) == ["g1", "g3"]
    _assert_same_generation(rows["g1"], reference("llama", "g1"))
    assert rows["g3"]["completion_tokens"] == 3


def _garbled_ids(path: Path, group: int) -> bytes:
    """The bytes of the Parquet file ``path`` with the pages of row group ``group``'s first column garbled."""
    column = pq.ParquetFile(path).metadata.row_group(group).column(0)
    data = bytearray(path.read_bytes())
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    for i in range(start, start + column.total_compressed_size):
        data[i] ^= 0x5A
    return bytes(data)


def test_parquet_damaged_part_way_is_one_line_naming_the_row(models: dict[str, Path], tmp_path: Path) -> None:
    """A Parquet file whose fourth row group's pages are garbled (pyarrow's error spans lines): one line naming the
    file and the first row not read, exit 2, and no partial output left when no row had finished, so that the rerun
    on the mended file needs neither --resume nor --overwrite."""
    rows = [{"id": f"r{i}", "prompt": "The quick", "max_new_tokens": 1} for i in range(200)]
    good = tmp_path / "good.parquet"
    pq.write_table(pa.Table.from_pylist(rows), good, row_group_size=50)
    dataset = tmp_path / "in.parquet"
    dataset.write_bytes(_garbled_ids(good, group=3))  # rows 151-200
    out = tmp_path / "out.arrow"
    code, lines = _run(dataset, out, models["llama"])
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"batchgen: error: {dataset}: cannot read from row 151 on: ")
    assert not out.exists() and not partial_dir(out).exists()
    dataset.write_bytes(good.read_bytes())
    assert _run(dataset, out, models["llama"])[0] == 0
    assert len(read_results(out)) == 200
    # One row group, damaged (found by a review: its message named no row).
    one = tmp_path / "one.parquet"
    pq.write_table(pa.Table.from_pylist(rows[:50]), one)
    one.write_bytes(_garbled_ids(one, group=0))
    code, lines = _run(one, tmp_path / "one.arrow", models["llama"])
    assert code == 2 and lines[0].startswith(f"batchgen: error: {one}: cannot read from row 1 on: "), lines


def test_arrow_with_damaged_values_is_one_line_naming_the_row(models: dict[str, Path], tmp_path: Path) -> None:
    """An Arrow IPC file whose second batch holds a string column with a damaged offset (pyarrow failed in
    ``to_pylist``, a traceback): one line naming the file and the batch's first row, with progress on too; no partial
    output left."""
    prompts = pa.array(["The quick"] * 300)
    offsets = list(range(0, 9 * 301, 9))
    offsets[250] = -5
    damaged = pa.Array.from_buffers(pa.string(), 300, [None, pa.py_buffer(pa.array(offsets, pa.int32()).buffers()[1]),
                                                       prompts.buffers()[2]])  # fmt: skip
    ids = pa.array([f"r{i}" for i in range(300)])
    dataset = tmp_path / "in.arrow"
    with pa.ipc.new_file(dataset, pa.schema([("id", pa.string()), ("prompt", pa.string())])) as writer:
        writer.write_batch(pa.record_batch([ids[:200], prompts[:200]], names=["id", "prompt"]))
        writer.write_batch(pa.record_batch([ids[200:], damaged[200:]], names=["id", "prompt"]))
    out = tmp_path / "out.arrow"
    for progress in ("--no-progress", "--progress"):
        code, lines = _run(dataset, out, models["llama"], progress)
        assert code == 2 and [line for line in lines if "error" in line] == lines[-1:], lines
        assert lines[-1].startswith(f"batchgen: error: {dataset}: not a valid Arrow file from row 201 on (")
        assert not out.exists() and not partial_dir(out).exists()


def test_prompt_one_token_below_context_is_generated(models: dict[str, Path], tmp_path: Path) -> None:
    # The boundary next to "prompt_token_ids_at_context": 15 tokens fit a 16-token context, leaving room for one.
    row = {"id": "edge", "prompt_token_ids": [0] + [5] * 14, "max_new_tokens": 8, "temperature": 0}
    dataset = write_jsonl(tmp_path / "in.jsonl", [row])
    code, lines = _run(dataset, tmp_path / "out.arrow", models["llama"], *CONTEXT)
    assert code == 0, lines
    [got] = read_results(tmp_path / "out.arrow").to_pylist()
    assert (got["prompt_tokens"], got["completion_tokens"], got["finish_reason"]) == (15, 1, "length")


def test_every_row_bad_writes_no_output(models: dict[str, Path], tmp_path: Path) -> None:
    """A run whose rows are all bad leaves no output file and no partial output (found by a new user: an empty
    file made the next try need --overwrite); after the rows are fixed the same command runs."""
    rows = [{"id": "a", "text": "hi", "max_new_tokens": 2}, {"id": "b", "text": "ho", "max_new_tokens": 2}]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.arrow"
    code, lines = _run(dataset, out, models["llama"])
    assert code == 3, lines
    assert [line for line in lines if line.startswith("batchgen: error: ")] == [
        *(f"batchgen: error: {dataset}:{i}: field 'prompt': row has no prompt: give one of prompt, messages, "
          "prompt_token_ids (found 'text', 'max_new_tokens'; rename 'text' to 'prompt' or pass --prompt-column text)"
          for i in (1, 2)),
        "batchgen: error: 2 bad input rows left out (see above; --on-error skip writes them); no row was good, so "
        "no output file was written",
    ]  # fmt: skip
    assert _summary(lines)[:2] == (0, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
    write_jsonl(dataset, [{"id": r["id"], "prompt": r["text"], "max_new_tokens": 2} for r in rows])
    code, lines = _run(dataset, out, models["llama"])
    assert code == 0, lines
    assert sorted(r["id"] for r in read_results(out).to_pylist()) == ["a", "b"]


def test_every_row_bad_under_skip_writes_the_error_rows(models: dict[str, Path], tmp_path: Path) -> None:
    """Under --on-error skip the error rows are the output: it is written, and the run succeeds."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": 5}, {"id": "b", "prompt": 6}])
    out = tmp_path / "out.arrow"
    code, lines = _run(dataset, out, models["llama"], "--on-error", "skip")
    assert code == 0, lines
    got = read_results(out).to_pylist()
    assert [(r["id"], r["finish_reason"]) for r in got] == [("a", "error"), ("b", "error")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.arrow"]


# --- row-level errors, --on-error skip --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "rid"),
    [
        ("bad_json", "null"),  # no id anyone can read (its index may be another row's id)
        ("prompt_not_string", "bad"),
        ("top_p_above_1", "bad"),
        ("prompt_token_id_vocab", "bad"),
        ("prompt_text_over_context", "bad"),
        ("id_bool", "true"),  # a bad id: as the input wrote it, JSON
        ("id_list", "[1]"),
        ("id_empty", '""'),
        ("id_lone_surrogate", '"\\ud800"'),  # the id column holds text: the JSON escape
    ],
)
def test_skip_writes_bad_row_as_error(
    name: str, rid: str, models: dict[str, Path], reference: Any, tmp_path: Path
) -> None:
    case = CASES[name]
    dataset = _dataset(tmp_path / "in.jsonl", case.row)
    out = tmp_path / "out.arrow"
    code, lines = _run(dataset, out, models[case.model], "--on-error", "skip", *case.args)
    assert code == 0, lines
    assert not [line for line in lines if line.startswith("batchgen: error")]
    assert [line for line in lines if line.startswith("batchgen: warning")] == [
        f"batchgen: warning: {_expected_error(dataset, case)} (written as an error row)"
    ]
    assert _summary(lines)[1] == 1  # (1 bad row)
    rows = read_results(out).to_pylist()
    assert sorted(r["id"] for r in rows) == sorted(["g1", "g2", rid])
    _check_good_rows(rows, case.model, reference)
    [bad] = [r for r in rows if r["finish_reason"] == "error"]
    assert bad["id"] == rid
    assert bad["error"] == _expected_error(dataset, case)
    assert (bad["text"], bad["output_token_ids"], bad["prompt_tokens"], bad["completion_tokens"]) == (
        None,
        None,
        None,
        None,
    )


def test_skip_keeps_the_pass_through_fields_that_fit(models: dict[str, Path], tmp_path: Path) -> None:
    """An error row keeps the row's pass-through fields: after a bad sampling field (found when the request is
    built) as after a bad prompt field (found when the row is parsed)."""
    rows = [
        {"id": "g", "prompt": "hi", "max_new_tokens": 1, "keep": "A", "meta": {"a": 1}},
        {"id": "b1", "prompt": "hi", "temperature": "x", "keep": "B", "meta": {"a": 2}},
        {"id": "b2", "prompt": 5, "keep": "C", "meta": {"a": 3}},
    ]
    dataset = tmp_path / "in.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.arrow"
    code, lines = _run(dataset, out, models["llama"], "--on-error", "skip", "--max-new-tokens", "1")
    assert code == 0, lines
    got = {r["id"]: (r["finish_reason"], r["keep"], r["meta"]) for r in read_results(out).to_pylist()}
    assert got["b1"] == ("error", "B", {"a": 2})
    assert got["b2"] == ("error", "C", {"a": 3})


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("stop", [1, "\ud800"], "must be a string or a list of strings"),
        ("n", {"\ud800": 1}, "must be an integer"),
        ("n", {"k": "\udfff"}, "must be an integer"),
        ("temperature", ["\ud800"], "must be a number"),
    ],
)
def test_an_error_row_quoting_a_lone_surrogate_is_written(
    models: dict[str, Path], tmp_path: Path, field: str, value: Any, message: str
) -> None:
    """Found by a helper: under --on-error skip, an error message quoting a bad sampling value that holds a lone
    surrogate could not be stored (a traceback); it quotes it as JSON's \\u escape (``json.dumps``' default)."""
    dataset = tmp_path / "in.jsonl"
    dataset.write_text(json.dumps({"id": "b", "prompt": "hi", field: value}) + "\n")
    out = tmp_path / "out.arrow"
    code, lines = _run(dataset, out, models["llama"], "--on-error", "skip", "--max-new-tokens", "1")
    assert code == 0, lines
    assert read_results(out).column("error").to_pylist() == [
        f"{dataset}:1: field '{field}': {message}, got {json.dumps(value)}"
    ]


# --- file-level errors: one line, exit 2 at once ----------------------------------------------------------

FILE_LEVEL = [
    "missing_dataset",
    "empty_dataset",
    "blank_lines_dataset",
    "json_document_dataset",
    "parquet_named_jsonl",
    "gzip_named_jsonl",
    "arrow_stream_named_jsonl",
    "parquet_as_second_jsonl_shard",
    "unknown_model",
    "model_dir_without_config",
    "weights_cut_short",
    "model_dir_without_a_tokenizer",
    "output_dir_missing",
    "parquet_output_of_an_interval_column",
    "parquet_output_of_a_deep_list",
    "union_column",
    "deep_parquet_column",
    "output_exists",
    "unsupported_output_format",
    "unknown_dtype",
    "bad_on_error",
    "bad_config_key",
    "bad_cli_sampling_default",
    "bad_cli_prompt_logprobs",
    "output_is_a_directory",
    "flag_value_of_the_wrong_type",
    "comma_separated_flag_values",
    "float_flag_of_the_wrong_type",
    "unknown_flag",
    "flag_without_its_value",
    "another_engines_flag",
    "hfs_do_sample",
    "a_row_field_as_a_flag",
    "hfs_stop_strings",
    "beam_search",
]


# Cases that add flags: (the flags, the expected error line, whether it must be equal (else: contained)).
_FLAG_CASES: dict[str, tuple[list[str], str, bool]] = {
    "unknown_dtype": (["--dtype", "float8"], "unknown --dtype 'float8'; choose auto, float32, bfloat16, float16", True),
    "bad_on_error": (["--on-error", "ignore"], "--on-error must be auto, fail or skip, got 'ignore'", True),
    "bad_cli_sampling_default": (
        ["--temperature", "-1"],
        "--temperature: must be a number in [0, 10000], got -1.0",
        True,
    ),
    # Checked before the model loads, its vocabulary not known yet (found by a new user: "[0, 9223372036854775807]").
    "bad_cli_prompt_logprobs": (
        ["--prompt-logprobs", "-1"],
        "--prompt-logprobs: must be true, false or a count in [0, vocab size]",
        True,
    ),
    # Mistakes the command line's parser finds: its messages (typer's words), on one line as batchgen's own (found by
    # a new user: click's usage line, hint and error took three); the command's --help where the parser knows it.
    "flag_value_of_the_wrong_type": (
        ["--max-new-tokens", "ten"],
        "Invalid value for '--max-new-tokens': \"ten\" is not an integer",
        False,
    ),
    # Found by a new user: typer's words named neither the text nor, for a list, how to give several values.
    "comma_separated_flag_values": (
        ["--stop-token-ids", "1,2"],
        "Invalid value for '--stop-token-ids': \"1,2\" is not an integer (give the flag once for each value)",
        False,
    ),
    "float_flag_of_the_wrong_type": (
        ["--top-p", "high"],
        "Invalid value for '--top-p': \"high\" is not a number",
        False,
    ),
    "unknown_flag": (
        ["--max-tokenz", "3"],
        "No such option: --max-tokenz (Possible options: --max-new-tokens, ",
        False,
    ),
    "flag_without_its_value": (["--temperature"], "Option '--temperature' requires an argument.", True),
    # vLLM's flag for the context length: pointed at it alone, not at --max-total-tokens, the nearest spelling and
    # another setting (found by a vLLM user).
    "another_engines_flag": (
        ["--max-model-len", "512"],
        "No such option: --max-model-len (Possible options: --context-length) (see ",
        False,
    ),
    # HF's and SGLang's sampling names, said as a row's field is (found by an HF user: no hint, or a near spelling).
    "hfs_do_sample": (
        ["--do-sample"],
        "No such option: --do-sample (batchgen samples unless 'temperature' is 0: give temperature 0 for HF's "
        "do_sample false) (see ",
        False,
    ),
    "a_row_field_as_a_flag": (
        ["--logit-bias", "{}"],
        "No such option: --logit-bias ('logit_bias' is a row field: give it in each row) (see ",
        False,
    ),
    "hfs_stop_strings": (["--stop-strings", "x"], "No such option: --stop-strings (Possible options: --stop) (", False),
    "beam_search": (
        ["--num-beams", "4"],
        "No such option: --num-beams (another engine's option, which batchgen does not have) (see ",
        False,
    ),
}


def _file_level_case(name: str, tmp: Path, model: Path) -> tuple[list[str], str, bool]:
    """(CLI args, the expected error line, whether it must be equal (else: contained)) for one file-level case."""
    dataset = write_jsonl(tmp / "in.jsonl", [GOOD_1])
    out = tmp / "out.arrow"
    args = ["run", str(dataset), "--out", str(out), "--model", str(model), *COMMON]
    if name in _FLAG_CASES:
        flags, expected, exact = _FLAG_CASES[name]
        return [*args, *flags], expected, exact
    if name == "missing_dataset":
        missing = tmp / "nope.jsonl"
        args[1] = str(missing)
        return args, f"{missing}: no such file", True
    if name in ("empty_dataset", "blank_lines_dataset"):
        dataset.write_text("" if name == "empty_dataset" else "\n  \n\n")
        return args, f"{dataset}: dataset is empty", True
    if name == "json_document_dataset":
        dataset.write_text('[\n  {"prompt": "a"}\n]\n')
        return (
            args,
            f"{dataset}:1: not a JSON object; this looks like a JSON document, but batchgen reads JSON Lines "
            "(one object per line)",
            True,
        )
    if name == "parquet_named_jsonl":  # every line would be a row error: invalid UTF-8
        pq.write_table(pa.table({"prompt": ["a", "b"] * 40}), dataset, row_group_size=4)
        return args, f"{dataset}: not JSON Lines; this is a Parquet file: name it .parquet", True
    if name == "gzip_named_jsonl":
        dataset.write_bytes(gzip.compress(dataset.read_bytes() * 50))
        return args, f"{dataset}: not JSON Lines; this is gzip-compressed: decompress it first", True
    if name == "arrow_stream_named_jsonl":
        with pa.ipc.new_stream(dataset, pa.schema([("prompt", pa.string())])) as stream:
            stream.write_table(pa.table({"prompt": ["a", "b"] * 40}))
        return args, f"{dataset}: not JSON Lines; this is an Arrow IPC stream: name it .arrow", True
    if name == "parquet_as_second_jsonl_shard":
        shards = tmp / "shards"
        shards.mkdir()
        write_jsonl(shards / "a-0.jsonl", [GOOD_1])
        pq.write_table(pa.table({"prompt": ["a", "b"] * 40}), shards / "a-1.jsonl", row_group_size=4)
        args[1] = str(shards)
        return args, "a-1.jsonl: not JSON Lines; this is a Parquet file: name it .parquet", False
    if name == "unknown_model":
        args[5] = "no-such-model"
        return args, "unknown model 'no-such-model': expected a model directory, a .gguf file, a built-in name (", False
    if name == "model_dir_without_config":
        empty = tmp / "empty_model"
        empty.mkdir()
        args[5] = str(empty)
        return args, f"{empty}: not a model directory (no config.json)", True
    if name in ("weights_cut_short", "model_dir_without_a_tokenizer"):  # found by a helper: a traceback, cut text
        broken = tmp / "broken_model"
        broken.mkdir()
        for path in model.iterdir():
            if name == "weights_cut_short" or not path.name.startswith(("tokenizer", "special_tokens")):
                (broken / path.name).write_bytes(path.read_bytes())
        args[5] = str(broken)
        if name == "weights_cut_short":
            weights = broken / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[:1000])
            return args, f"{weights}: cannot read the weights: Error while deserializing header: ", False
        return args, "Couldn't instantiate the backend tokenizer from one of: (1) a `tokenizers` library", False
    if name == "deep_parquet_column":  # Parquet reads 70 levels, Arrow writes 64 (found by a review: a traceback)
        deep: Any = 1
        for _ in range(69):
            deep = {"x": deep}
        table = tmp / "in.parquet"
        pq.write_table(pa.table({"prompt": ["a"], "c": [deep]}), table)
        args[1] = str(table)
        return args, f"{table}: column 'c' nests 70 deep, past the 64 Arrow writes; drop it, or store it as", False
    if name == "parquet_output_of_a_deep_list":  # written, then unreadable: Parquet reads 100 levels, 2 a list
        deep = 1
        for _ in range(55):
            deep = [deep]
        dataset.write_text(json.dumps({"prompt": "a", "c": deep}) + "\n")
        parquet = tmp / "out.parquet"
        args[3] = str(parquet)
        return args, f"{parquet}: Parquet cannot store the column 'c' (list<", False
    if name in ("parquet_output_of_an_interval_column", "union_column"):  # found by a helper: see the messages
        table = tmp / "in.arrow"
        if name == "union_column":
            column = pa.UnionArray.from_sparse(pa.array([0, 1], pa.int8()), [pa.array([1, 2]), pa.array(["x", "y"])])
        else:
            column = pa.array([pa.MonthDayNano([1, 2, 3]), None], pa.month_day_nano_interval())
        with pa.ipc.new_file(table, pa.schema([("prompt", pa.string()), ("c", column.type)])) as writer:
            writer.write_table(pa.table({"prompt": ["a", "b"], "c": column}))
        args[1] = str(table)
        if name == "union_column":
            type_name = "sparse_union<0: int64=0, 1: string=1>"
            message = f"column 'c' is a union ({type_name}), which batchgen cannot pass through; drop it, or cast it"
            return args, f"{table}: {message} to one type", True
        parquet = tmp / "out.parquet"
        args[3] = str(parquet)
        message = "Parquet cannot store the column 'c' (month_day_nano_interval: Unhandled type for Arrow to Parquet"
        return (
            args,
            f"{parquet}: {message} schema conversion: month_day_nano_interval); write a .arrow or .jsonl",
            False,
        )
    if name == "output_dir_missing":
        missing_out = tmp / "no_dir" / "out.arrow"
        args[3] = str(missing_out)
        return args, f"{missing_out}: directory {missing_out.parent} does not exist", True
    if name == "output_exists":
        out.write_text("keep me")
        return (
            args,
            f"{out}: output file exists; pass --resume to finish or keep it, or --overwrite to replace it",
            True,
        )
    if name == "unsupported_output_format":
        csv = tmp / "out.csv"
        args[3] = str(csv)
        return (
            args,
            f"{csv}: unsupported output format '.csv' (use .arrow, .ipc, .feather, .parquet or .jsonl)",
            True,
        )
    if name == "bad_config_key":
        config = tmp / "bad.yaml"
        config.write_text("max_tokens: 3\n")
        args += ["--config", str(config)]
        return args, f"{config}: unknown option 'max_tokens'", False
    if name == "output_is_a_directory":  # found by a new user: "unsupported output format ''"
        args[3] = str(tmp)
        return args, f"{tmp}: is a directory, expected an output file", True
    raise AssertionError(name)


@pytest.mark.parametrize("name", FILE_LEVEL)
def test_file_level_error_is_one_line(name: str, models: dict[str, Path], tmp_path: Path) -> None:
    args, expected, exact = _file_level_case(name, tmp_path, models["llama"])
    out = Path(args[3])
    code, output = run_cli(args)
    lines = [line for line in output.splitlines() if line.strip()]
    assert code == 2, output
    assert "Traceback" not in output
    assert len(lines) == 1, output
    if exact:
        assert lines[0] == f"batchgen: error: {expected}"
    else:
        assert lines[0].startswith("batchgen: error: ") and expected in lines[0], lines[0]
    if name == "output_exists":
        assert out.read_text() == "keep me"
    elif name == "output_is_a_directory":
        assert out.is_dir()
    else:
        assert not out.exists()


# --- the real entry points, in a subprocess (each ~4 s, so only two) --------------------------------------


def _subprocess_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1"}


def test_python_m_batchgen_missing_dataset_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "batchgen", "run", str(missing), "--out", str(tmp_path / "out.arrow")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_subprocess_env(),
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [f"batchgen: error: {missing}: no such file"]
    assert result.stdout == ""
    assert not (tmp_path / "out.arrow").exists()


def test_console_script_unknown_model_one_line(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "batchgen"
    assert script.is_file(), f"the batchgen console script is not installed next to {sys.executable}"
    dataset = write_jsonl(tmp_path / "in.jsonl", [GOOD_1])
    result = subprocess.run(
        [str(script), "run", str(dataset), "--out", str(tmp_path / "out.arrow"), "--model", "no-such-model"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_subprocess_env(),
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("batchgen: error: unknown model 'no-such-model': expected a model directory")
    assert result.stdout == ""
    assert not (tmp_path / "out.arrow").exists()


def test_an_unreadable_line_takes_no_id(random_models: dict[str, Path], tmp_path: Path) -> None:
    """Line 2 cannot be parsed, so its id is unknown: its error row is called ``null`` and claims no id, so that the
    output holds no id twice (found by a new user: its error row took the index 1, beside the row naming id 1) and a
    later row naming its index is generated (found by a helper: it was refused as a duplicate of the broken line)."""
    dataset = tmp_path / "in.jsonl"
    dataset.write_text('{"prompt": "A"}\ngarbage\n{"id": 1, "prompt": "C"}\n')
    out = tmp_path / "out.jsonl"
    code, output = run_cli(
        [
            "run", str(dataset), "--out", str(out), "--model", str(random_models["llama"]), "--device", "cpu",
            "--max-new-tokens", "2", "--no-progress", "--on-error", "skip",
        ]
    )  # fmt: skip
    assert code == 0, output
    rows = read_results(out).to_pylist()
    assert sorted(r["id"] for r in rows if r["finish_reason"] != "error") == ["0", "1"]
    errors = [(r["id"], r["error"]) for r in rows if r["finish_reason"] == "error"]
    assert [rid for rid, _ in errors] == ["null"] and errors[0][1].startswith(f"{dataset}:2: invalid JSON"), errors
