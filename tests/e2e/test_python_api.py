"""The Python API through ``batchgen``'s public names: ``Generator.generate``/``stream`` give the rows that
``batchgen run`` (the tested reference) writes for the same input, and ``batchgen.run`` writes the CLI's output."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

import batchgen
from batchgen.errors import BadRowsLeftOut, BatchgenError, RowError
from batchgen.io.partial_output import partial_dir
from batchgen.io.writer import OUTPUT_COLUMNS, read_results
from tests.helpers.cli import generate, read_rows, run_cli, write_jsonl

# A minimal chat template: "<s>role: content\n..." then "assistant:".
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
ENGINE = {"dtype": "float32", "device": "cpu", "seed": 7, "max_running_requests": 4}
ENGINE_FLAGS = ["--seed", "7", "--max-running-requests", "4"]


@pytest.fixture(scope="module")
def chat_model(random_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random llama with a chat template."""
    path = tmp_path_factory.mktemp("api") / "chat_model"
    shutil.copytree(random_models["llama"], path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def generator(chat_model: Path) -> batchgen.Generator:
    # schedule_lookahead 1: stream reads 2 x max_running_requests = 8 rows ahead.
    return batchgen.Generator(str(chat_model), schedule_lookahead=1, **ENGINE)


def _comparable(row: dict[str, Any]) -> dict[str, Any]:
    """A result row with top logprobs as (id, logprob) pairs, as the file's {id, logprob} structs read back."""
    out = dict(row)
    for key in ("top_logprobs", "prompt_top_logprobs"):
        if out.get(key) is not None:
            out[key] = [[(t["id"], t["logprob"]) if isinstance(t, dict) else tuple(t) for t in pos] for pos in out[key]]
    return out


_LOGPROB_COLUMNS = ("output_logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs", "prompt_logprob_sum")


def _without_logprobs(row: dict[str, Any]) -> tuple[dict[str, Any], list[float]]:
    """``row`` as :func:`_comparable` gives it, its logprob values taken out (top lists keep their ids), and them."""
    out, values = _comparable(row), []
    for key in _LOGPROB_COLUMNS:
        column = out.get(key)
        if column is None:
            continue
        if key == "prompt_logprob_sum":
            values.append(column)
            out[key] = "given"
        elif key.endswith("top_logprobs"):
            values += [logprob for position in column for _, logprob in position]
            out[key] = [[token for token, _ in position] for position in column]
        else:
            values += column
            out[key] = len(column)
    return out, values


def _assert_same_results(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """The same result rows, their logprobs to 1e-5: a later call finds its prompt in the prefix cache and computes
    the rest in other shapes, which round otherwise in the last bits where --deterministic is not the default (a
    CPU with AMX or without AVX2, no C++ kernels: BATCHGEN_CPU_ATTENTION_KERNEL=0 shows it)."""
    assert len(got) == len(want)
    for row, other in zip(got, want, strict=True):
        (row_rest, row_values), (other_rest, other_values) = _without_logprobs(row), _without_logprobs(other)
        assert row_rest == other_rest
        assert row_values == pytest.approx(other_values, abs=1e-5)


def test_generate_gives_the_rows_batchgen_run_writes(
    generator: batchgen.Generator, chat_model: Path, tmp_path: Path
) -> None:
    # One row of each kind; sampled (temperature 1) with seeds derived from --seed 7 and the ids, n = 2, logprobs.
    dict_row = {"id": "p", "prompt": "Numbers like", "n": 2, "top_logprobs": 2, "text": "kept", "tags": ["a", "b"]}
    python_rows: list[Any] = [
        "Once upon a time",
        [{"role": "user", "content": "The quick brown fox"}],
        [5, 6, 7, 8],
        dict_row,
        {"prompt": "Café", "temperature": 0, "max_tokens": 3},
    ]
    file_rows = [
        {"prompt": "Once upon a time"},
        {"messages": [{"role": "user", "content": "The quick brown fox"}]},
        {"prompt_token_ids": [5, 6, 7, 8]},
        dict_row,
        {"prompt": "Café", "temperature": 0, "max_tokens": 3},
    ]
    dataset = write_jsonl(tmp_path / "in.jsonl", file_rows)
    expected = generate(dataset, tmp_path / "out.arrow", chat_model, "--max-new-tokens", "6", *ENGINE_FLAGS)

    got = generator.generate(python_rows, max_new_tokens=6)

    assert [(r["id"], r["sample_index"]) for r in got] == [("0", 0), ("1", 0), ("2", 0), ("p", 0), ("p", 1), ("4", 0)]
    assert expected.keys() == {"0", "1", "2", "p", "4"}
    file_samples = _samples(tmp_path / "out.arrow")
    for row in got:
        assert set(OUTPUT_COLUMNS.names) <= row.keys()
        reference = _comparable(file_samples[row["id"], row["sample_index"]])
        assert _comparable(row) == {key: reference[key] for key in row}, row["id"]
    assert got[3]["input_text"] == "kept" and got[3]["tags"] == ["a", "b"]  # pass-through, renamed as in a file
    assert "input_text" not in got[0]  # only a dict row's own fields pass through
    assert expected["4"]["completion_tokens"] == 3


def test_generate_keeps_input_order_and_stream_yields_finishing_order(generator: batchgen.Generator) -> None:
    rows = [{"prompt": "a b c", "max_new_tokens": 8, "ignore_eos": True}, {"prompt": "d", "max_new_tokens": 1}]
    in_order = generator.generate(rows)
    streamed = list(generator.stream(rows))
    assert [r["id"] for r in in_order] == ["0", "1"]
    assert generator.generate([]) == [] and list(generator.stream(iter([]))) == []
    # Row 1's one token comes from its prefill round; row 0 decodes 7 more.
    assert [r["id"] for r in streamed] == ["1", "0"]
    assert [r["completion_tokens"] for r in streamed] == [1, 8]
    # The same seeds (--seed 7 and the ids); logprobs may differ in the last bits: the second call's prompts come
    # from the prefix cache, which changes the shapes the model computes them in.
    tokens = [(r["id"], r["output_token_ids"], r["text"]) for r in in_order]
    assert sorted((r["id"], r["output_token_ids"], r["text"]) for r in streamed) == tokens


def test_stream_reads_a_generator_lazily_and_yields_each_row_once(generator: batchgen.Generator) -> None:
    read = 0

    def rows() -> Iterator[str]:
        nonlocal read
        for i in range(40):
            read += 1
            yield f"row {i}"

    results = generator.stream(rows(), max_new_tokens=2)
    assert read == 0  # nothing is read before the first result is asked for
    first = next(results)
    # At most 8 rows wait (2 x max_running_requests) and 4 run, whatever the input holds.
    assert read <= 8 + 4
    ids = [first["id"], *(r["id"] for r in results)]
    assert sorted(ids, key=int) == [str(i) for i in range(40)]


def test_a_closed_stream_leaves_the_generator_ready(generator: batchgen.Generator) -> None:
    results = generator.stream(["one", "two", "three"] * 4, max_new_tokens=4)
    next(results)
    with pytest.raises(RuntimeError, match="still open"):
        generator.generate(["x"])
    results.close()
    assert [r["completion_tokens"] for r in generator.generate(["x"], max_new_tokens=2, ignore_eos=True)] == [2]


def test_a_script_that_ends_with_a_stream_open_ends_quietly(chat_model: Path) -> None:
    """Found by a new user: the stream's cleanup ran from the collector after the modules it uses were torn down,
    printing ``Exception ignored in: <generator object ...>`` and a TypeError traceback."""
    code = (
        "import batchgen\n"
        f"g = batchgen.Generator({str(chat_model)!r}, dtype='float32', device='cpu', max_running_requests=2)\n"
        "results = g.stream(['one', 'two', 'three', 'four'], max_new_tokens=4, ignore_eos=True)\n"
        "print(next(results)['completion_tokens'])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (result.returncode, result.stdout, result.stderr) == (0, "4\n", "")


@pytest.mark.parametrize("call", ["stream", "generate"])
def test_a_script_that_ends_while_a_daemon_thread_generates_exits_cleanly(chat_model: Path, call: str) -> None:
    """Found by a review: the interpreter stopped a daemon thread inside a round's C++ code and the process aborted
    ("terminate called without an active exception", exit 134). The call now ends at its next round at exit."""
    count = "sum(1 for _ in g.stream(rows, **kw))" if call == "stream" else "len(g.generate(rows, **kw))"
    code = (
        "import threading, time, batchgen\n"
        f"g = batchgen.Generator({str(chat_model)!r}, dtype='float32', device='cpu', max_running_requests=4)\n"
        "rows, kw = ['one'] * 20000, {'max_new_tokens': 64, 'ignore_eos': True}\n"
        f"def work():\n    print('done', {count}, flush=True)\n"
        "threading.Thread(target=work, daemon=True).start()\n"
        "time.sleep(2)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    # It was stopped, not finished (20,000 rows of 64 tokens take minutes); the thread, stopped in turn by the
    # interpreter, may not print all of its line.
    words = result.stdout.split()
    assert len(words) < 2 or int(words[1]) < 20000


def test_a_bad_row_raises_naming_the_row_and_field_before_anything_runs(generator: batchgen.Generator) -> None:
    rounds = generator.engine.stats.rounds
    with pytest.raises(RowError, match=r"^rows:2: field 'temperature': must be a number, got \"hot\"$") as error:
        generator.generate(["fine", {"prompt": "x", "temperature": "hot"}, {"prompt": "y", "top_p": 0}])
    assert (error.value.line, error.value.field) == (2, "temperature")
    assert generator.engine.stats.rounds == rounds  # the good row did not run either
    with pytest.raises(RowError, match=r"^rows:1: must be a prompt string, a message list, a token-id list or a dict"):
        generator.generate([3.5])
    with pytest.raises(RowError, match=r"^rows:2: field 'id': duplicate id 'a'$"):
        list(generator.stream([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}]))
    # A row without an id (a null one too: a pandas NaN) takes its 0-based index: a clash says so, either way round.
    with pytest.raises(RowError, match=r"^rows:2: field 'id': duplicate id '1': the row has no id, and its default, "):
        generator.generate([{"id": 1, "prompt": "x"}, {"id": None, "prompt": "y"}])
    with pytest.raises(RowError, match=r"^rows:3: field 'id': duplicate id '1': an earlier row without an id took it"):
        generator.generate(["x", "y", {"id": 1, "prompt": "z"}])


def test_a_stream_raises_at_a_bad_row_after_the_results_of_every_row_before_it(
    generator: batchgen.Generator,
) -> None:
    rows: list[Any] = [f"row {i}" for i in range(30)]
    rows[25] = {"prompt": "late", "n": "two"}
    read: list[int] = []

    def reading() -> Iterator[Any]:
        for i, row in enumerate(rows):
            read.append(i)
            yield row

    seen = []
    with pytest.raises(RowError, match=r"^rows:26: field 'n': must be an integer, got \"two\"$"):
        for result in generator.stream(reading(), max_new_tokens=2):
            seen.append(result["id"])
    # Row 26 is read while the first rows run (8 ahead of them), yet every row before it finishes and is yielded
    # first (found by a new user: with the default lookahead of 4,096 rows, all work before a bad row was lost);
    # nothing after it is read.
    assert sorted(seen, key=int) == [str(i) for i in range(25)]
    assert read == list(range(26))
    assert not generator.engine.has_work()


class _FrameLike:
    """What the Python API sees of a pandas DataFrame (pandas is not installed here): iterating it gives its column
    labels (pandas' documented ``DataFrame.__iter__``), ``to_dict("records")`` its rows."""

    columns = ("prompt", "max_new_tokens")

    def __iter__(self) -> Iterator[str]:
        return iter(self.columns)

    def to_dict(self, orient: str) -> list[dict[str, Any]]:
        return [{"prompt": "a", "max_new_tokens": 2}]


def test_a_dataframe_is_refused_not_read_as_its_column_names(generator: batchgen.Generator) -> None:
    """Found by a new user: generate(df) generated for each column name."""
    with pytest.raises(BatchgenError, match=r"^rows: a DataFrame iterates its column names.*df.to_dict\('records'\)$"):
        generator.generate(_FrameLike())
    assert len(generator.generate(_FrameLike().to_dict("records"))) == 1


def test_a_lone_prompt_or_row_dict_is_one_row(generator: batchgen.Generator) -> None:
    """Found by a new user: generate("Once upon a time") generated for each character, and generate({...}) for each
    key. vLLM's ``LLM.generate`` takes one prompt as it is (its documented ``prompts`` argument: a prompt or a
    sequence of them); here it is one row, as in a list."""
    row = {"id": "q", "prompt": "Hi there friend", "topic": "x"}
    for lone, listed in (("Once upon a time", ["Once upon a time"]), (row, [row])):
        got = generator.generate(lone, max_new_tokens=2, temperature=0)
        assert len(got) == 1
        _assert_same_results(got, generator.generate(listed, max_new_tokens=2, temperature=0))
        assert [r["id"] for r in generator.stream(lone, max_new_tokens=2, temperature=0)] == [got[0]["id"]]
    assert got[0]["id"] == "q" and got[0]["topic"] == "x"


def test_a_lone_token_id_list_or_conversation_is_one_row(generator: batchgen.Generator) -> None:
    """Found by a new user: generate([1, 2, 3]) made a bad row of each id, and generate(conversation) a row of each
    message. vLLM's ``LLM.chat`` takes one conversation as it is (a list of messages, or a list of such lists); a
    list of dicts that are rows (with a prompt field) stays rows."""
    ids = [1, 41, 293]
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for lone in (ids, np.array(ids), conversation):
        got = generator.generate(lone, max_new_tokens=2, temperature=0)
        assert len(got) == 1
        _assert_same_results(got, generator.generate([lone], max_new_tokens=2, temperature=0))
    as_array = np.empty(len(conversation), dtype=object)  # what pandas gives for a list column's value
    as_array[:] = conversation
    lone_too = ([1.0, 41.0, 293.0], as_array, torch.tensor(ids))  # a tokenizer's ids as a tensor too
    for lone in lone_too:
        assert len(generator.generate(lone, max_new_tokens=1)) == 1
    rows = [{"prompt": "Hi", "role": "a"}, {"prompt": "Yo", "role": "b"}]
    assert [r["role"] for r in generator.generate(rows, max_new_tokens=1)] == ["a", "b"]
    # Rows whose prompt a column option makes stay rows, whatever their fields (found by a review).
    rows = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Yo"}]
    assert len(generator.generate(rows, prompt_template="Say: {content}", max_new_tokens=1)) == 2
    assert len(generator.generate(rows, prompt_column="content", max_new_tokens=1)) == 2
    assert generator.generate([], max_new_tokens=1) == []
    assert generator.generate(np.array([], dtype=np.int64), max_new_tokens=1) == []
    # Ids written as floats with no fraction (a JSON writer's, pandas') are those integers, as integer fields take them.
    as_floats = generator.generate([{"prompt_token_ids": [1.0, 41.0]}], max_new_tokens=2, temperature=0)
    assert (
        as_floats[0]["output_token_ids"]
        == generator.generate([[1, 41]], max_new_tokens=2, temperature=0)[0]["output_token_ids"]
    )


def test_include_stop_str_in_output_ends_text_with_the_stop_string(generator: batchgen.Generator) -> None:
    """vLLM's include_stop_str_in_output (its SamplingParams: "whether to include the stop strings in output text"):
    the text runs to the end of the stop string that ended it, where it otherwise ends before it; the tokens are
    the same (found by a vLLM user: the field was refused)."""
    greedy = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = generator.generate(["Once upon a time"], **greedy)[0]["text"]
    # A stop string first found inside the text, away from its start (one character: the random model's text is
    # mostly parts of characters, U+FFFD, which are no stop to look for).
    at = next(k for k in range(1, len(full)) if full[k] != "\ufffd" and full.find(full[k]) == k)
    stop = full[at]
    cut, kept = (
        generator.generate(
            [{"prompt": "Once upon a time", "include_stop_str_in_output": include}], stop=[stop], **greedy
        )[0]
        for include in (False, True)
    )
    assert cut["text"] == full[:at] and kept["text"] == full[: at + 1]
    assert cut["matched_stop"] == kept["matched_stop"] == stop and kept["finish_reason"] == "stop"
    assert cut["output_token_ids"] == kept["output_token_ids"]


def test_chat_template_kwargs_reach_the_chat_template(generator: batchgen.Generator) -> None:
    """vLLM's chat_template_kwargs (``{"enable_thinking": false}`` for Qwen3's template): the row's messages render
    as transformers' ``apply_chat_template`` renders them with those arguments; a null one is left out."""
    tokenizer = generator.engine.tokenizer
    kept = tokenizer.chat_template
    tokenizer.chat_template = (
        CHAT_TEMPLATE + "{% if enable_thinking is defined and not enable_thinking %} ok{% endif %}"
    )
    messages = [{"role": "user", "content": "Hi"}]
    try:
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, enable_thinking=0
        )
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        rows = [
            {"id": "kw", "messages": messages, "chat_template_kwargs": {"enable_thinking": False, "other": None}},
            {"id": "plain", "messages": messages},
            {"id": "ids", "prompt_token_ids": ids},
        ]
        got = {r["id"]: r for r in generator.generate(rows, max_new_tokens=3, temperature=0)}
        # The keyword sets them for every messages row of the call (vLLM's LLM.chat(chat_template_kwargs=...)).
        (run_level,) = generator.generate(
            [messages], max_new_tokens=3, temperature=0, chat_template_kwargs={"enable_thinking": False}
        )
    finally:
        tokenizer.chat_template = kept
    assert rendered.endswith("assistant: ok") and got["kw"]["prompt_tokens"] == len(ids)
    assert got["plain"]["prompt_tokens"] < len(ids)
    assert got["kw"]["output_token_ids"] == got["ids"]["output_token_ids"] == run_level["output_token_ids"]
    assert run_level["prompt_tokens"] == len(ids)


def test_a_prompt_over_the_tokenizers_max_length_brings_no_transformers_warning(
    generator: batchgen.Generator, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by a new user: transformers warned "Token indices sequence length is longer than the specified maximum"
    for a prompt over the tokenizer's ``model_max_length``, which is not the context batchgen holds a row to: a
    row within the context ran with that warning, a longer one got it before batchgen's own error."""
    from transformers.utils import logging as hf_logging

    tokenizer, verbosity = generator.engine.tokenizer, hf_logging.get_verbosity()
    kept = tokenizer.model_max_length
    tokenizer.model_max_length = 4
    hf_logging.set_verbosity_warning()  # a CLI test in this process may have turned transformers' notes off
    try:
        got = generator.generate("one two three four five six seven eight", max_new_tokens=1)
    finally:
        tokenizer.model_max_length = kept
        hf_logging.set_verbosity(verbosity)
    assert got[0]["prompt_tokens"] > 4 and got[0]["error"] is None
    assert not [r for r in caplog.records if "Token indices" in r.getMessage()]


def test_a_nan_in_a_field_batchgen_reads_is_a_missing_value(generator: batchgen.Generator) -> None:
    """pandas' ``to_dict("records")`` writes a missing number as NaN, and an integer column with one as floats
    (pandas' missing-data documentation): such a row takes the call's defaults, as one without the fields does."""
    nan = float("nan")
    records = [
        {"prompt": "Hello", "temperature": 0.0, "seed": 7.0, "max_new_tokens": 3.0},
        {"prompt": "Hello", "temperature": nan, "seed": nan, "max_new_tokens": nan},
    ]
    got = generator.generate(records, temperature=0.0, max_new_tokens=3)
    alone = generator.generate([{"prompt": "Hello"}], temperature=0.0, max_new_tokens=3)
    assert got[1]["output_token_ids"] == alone[0]["output_token_ids"] == got[0]["output_token_ids"]
    assert len(got[1]["output_token_ids"]) == 3


def test_on_error_skip_gives_error_rows_in_their_place(generator: batchgen.Generator) -> None:
    rows: list[Any] = ["fine", {"prompt": "x", "top_p": 0}, {"id": "k", "question": "What?", "source": 1}, 3.5]
    got = generator.generate(rows, on_error="skip", max_new_tokens=2)
    assert [r["id"] for r in got] == ["0", "1", "k", "null"]  # a row that is not a row claims no id
    assert [r["finish_reason"] for r in got][1:] == ["error"] * 3
    assert got[0]["error"] is None and got[0]["completion_tokens"] >= 1
    assert got[1]["error"] == "rows:2: field 'top_p': must be in (0, 1], got 0.0"
    assert "rename 'question' to 'prompt'" in got[2]["error"] and got[2]["source"] == 1
    assert got[3]["text"] is None and set(OUTPUT_COLUMNS.names) <= got[3].keys()
    streamed = {r["id"]: r for r in generator.stream(rows, on_error="skip", max_new_tokens=2)}
    assert streamed.keys() == {"0", "1", "k", "null"} and streamed["1"]["error"] == got[1]["error"]


def test_a_field_named_like_a_sampling_field_is_warned_about(generator: batchgen.Generator) -> None:
    with pytest.warns(UserWarning) as caught:
        got = generator.generate([{"prompt": "x", "Temperature": 0.5, "best_of": 2}], max_new_tokens=1)
    messages = {str(w.message) for w in caught}
    assert (
        "rows: field 'Temperature' is not a sampling field (did you mean 'temperature'?); it is passed through unused"
        in messages
    )
    assert (
        "rows: field 'best_of' is not supported: batchgen has no such option; it is passed through unused" in messages
    )
    assert got[0]["Temperature"] == 0.5 and got[0]["best_of"] == 2  # passed through, as a file's fields are
    assert {w.filename for w in caught} == {__file__}  # the line that gave the rows, not one inside batchgen


def test_a_datasets_dataset_with_column_options(generator: batchgen.Generator) -> None:
    from datasets import Dataset

    data = Dataset.from_dict({"qid": ["a", "b"], "question": ["Why?", "How?"], "answer": ["x", "y"]})
    got = generator.generate(data, prompt_template="Q: {question}\\nA:", id_column="qid", max_new_tokens=3)
    want = generator.generate(
        [{"id": "a", "prompt": "Q: Why?\nA:"}, {"id": "b", "prompt": "Q: How?\nA:"}], max_new_tokens=3
    )
    assert [(r["id"], r["text"], r["answer"]) for r in got] == [(w["id"], w["text"], a) for w, a in zip(want, "xy")]
    with pytest.raises(BatchgenError, match="rows: --prompt-column query: no column 'query'"):
        generator.generate(data, prompt_column="query")
    with pytest.raises(RowError, match="rows:2: field 'question': null or missing"):
        generator.generate([{"question": "Why?"}, {"question": None}], prompt_column="question")


def test_row_field_keywords_take_numpy_values(generator: batchgen.Generator) -> None:
    """Found by a helper: ``allowed_token_ids=np.array([...])`` was refused ("must be a list of integers"), where the
    same array in a row dict is read as the list it holds."""
    greedy = {"temperature": 0, "max_new_tokens": 4}
    got = generator.generate(["x"], allowed_token_ids=np.array([29, 30]), **greedy)
    want = generator.generate(["x"], allowed_token_ids=[29, 30], **greedy)
    assert got[0]["output_token_ids"] == want[0]["output_token_ids"] and set(got[0]["output_token_ids"]) <= {29, 30}


def test_sglangs_sampling_params_dict_and_row_fields_for_every_row(generator: batchgen.Generator) -> None:
    """SGLang's ``Engine.generate(prompts, sampling_params)``: the dict's entries are the call's keywords, and the
    row fields that are no run option (``regex``, ``json_schema``, ``logit_bias``...) apply to every row that gives
    none of its own (found by an HF/SGLang user: the dict was a TypeError, and regex a keyword batchgen refused).
    Each row equals the row that carries those fields itself."""
    greedy = {"temperature": 0, "max_new_tokens": 6}
    rows = ["Once upon a time", {"prompt": "The dog", "regex": "[a-c]+"}, {"prompt": "Hi", "logit_bias": {"7": -9}}]
    got = generator.generate(rows, {**greedy, "regex": "[0-9 ]+"}, logit_bias={5: 100.0})
    want = generator.generate(
        [
            {"prompt": "Once upon a time", "regex": "[0-9 ]+", "logit_bias": {"5": 100}},
            {"prompt": "The dog", "regex": "[a-c]+", "logit_bias": {"5": 100}},
            {"prompt": "Hi", "regex": "[0-9 ]+", "logit_bias": {"7": -9}},
        ],
        **greedy,
    )
    assert [r["output_token_ids"] for r in got] == [r["output_token_ids"] for r in want]
    assert re.fullmatch("[0-9 ]+", got[0]["text"]) and re.fullmatch("[a-c]+", got[1]["text"])
    assert got[0]["output_token_ids"] != generator.generate(rows[:1], **greedy)[0]["output_token_ids"]
    with pytest.raises(TypeError, match="got 'temperature' both in sampling_params and as a keyword"):
        generator.generate(["x"], {"temperature": 0}, temperature=1)
    with pytest.raises(TypeError, match="sampling_params must be a dict of sampling fields"):
        generator.generate(["x"], 0.5)  # type: ignore[arg-type]
    with pytest.raises(BatchgenError, match="^logit_bias: key 'x' is not a token id$"):
        generator.generate(["x"], logit_bias={"x": 1})
    # Found by a review: SGLang's list of one dict per prompt, on_error in the dict, keys that are no names.
    with pytest.raises(TypeError, match="sampling_params must be one dict for every row; a row's own fields go in"):
        generator.generate(["x"], [{"temperature": 0}])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="on_error is generate\\(\\)'s own keyword"):
        generator.generate(["x"], {"on_error": "skip"})
    with pytest.raises(TypeError, match="sampling_params' keys must be strings"):
        generator.generate(["x"], {1: 2})  # type: ignore[dict-item]
    # numpy's integers as logit_bias keys, as numpy's values are taken everywhere else.
    (biased,) = generator.generate(["x"], logit_bias={np.int64(5): 100.0}, **greedy)
    assert set(biased["output_token_ids"]) == {5}


def test_tuples_and_a_tokenizers_output_as_rows(generator: batchgen.Generator) -> None:
    """Found by an HF user: a token-id tuple was refused with a message showing a list; a tokenizer's padded
    ``BatchEncoding`` was one row whose ``input_ids`` field was renamed in a hint that led nowhere."""
    ids = [1, 291, 280]
    want = generator.generate([ids], max_new_tokens=2, temperature=0)[0]["output_token_ids"]
    for rows in ([tuple(ids)], tuple(ids), [{"prompt_token_ids": tuple(ids)}]):
        (got,) = generator.generate(rows, max_new_tokens=2, temperature=0)  # type: ignore[arg-type]
        assert got["output_token_ids"] == want and got["prompt_tokens"] == 3
    # A padded tensor's rows are taken whole: said, since its pads become prompt tokens (found by a review).
    with pytest.warns(UserWarning, match="a 2-D array's rows are taken whole as prompt_token_ids, padding included"):
        generator.generate(np.array([ids, [2, 2, 5]]), max_new_tokens=1)
    encoding = {"input_ids": [ids, [2, 2, 5]], "attention_mask": [[1, 1, 1], [0, 0, 1]]}
    with pytest.raises(BatchgenError, match="^rows: a tokenizer's output \\(input_ids with an attention_mask\\)"):
        generator.generate(encoding)


def test_unknown_option_is_a_type_error_and_a_bad_value_the_cli_message(
    generator: batchgen.Generator, chat_model: Path, tmp_path: Path
) -> None:
    with pytest.raises(TypeError, match="Generator\\(\\) got an unexpected keyword argument 'dtyp'"):
        batchgen.Generator(str(chat_model), dtyp="float32")
    with pytest.raises(TypeError, match="'temperatur' \\(did you mean 'temperature'\\?\\)$"):
        generator.generate(["x"], temperatur=0)
    with pytest.raises(TypeError, match="'max_tokens' \\(did you mean 'max_new_tokens'\\?\\)$"):  # vLLM's name
        generator.generate(["x"], max_tokens=4)
    # vLLM's LLM arguments, pointed at batchgen's options (max_model_len was pointed at max_total_tokens, the nearest
    # spelling, another setting; found by a vLLM user).
    for vllm, meant in (("max_model_len", "context_length"), ("max_num_seqs", "max_running_requests")):
        with pytest.raises(TypeError, match=f"'{vllm}' \\(did you mean '{meant}'\\?\\)$"):
            batchgen.Generator(str(chat_model), **{vllm: 8})
    # An option another call takes, named so rather than by a near spelling (Generator(max_new_tokens=...) was
    # pointed at max_prefill_tokens; found by a review).
    for given in ("max_new_tokens", "max_tokens"):
        with pytest.raises(TypeError, match=f"'{given}' \\('max_new_tokens' is an option of generate\\(\\) and stream"):
            batchgen.Generator(str(chat_model), **{given: 8})
    with pytest.raises(TypeError, match="'max_running_requests'"):  # an engine option, not a sampling default
        generator.stream(["x"], max_running_requests=2)
    # HF's and SGLang's names, hinted as a row's fields are (found by an HF user: pad_token_id was pointed at
    # stop_token_ids, stop_strings too, return_logprob at top_logprobs; do_sample and num_beams had no hint).
    for given, said in (
        ("stop_strings", "did you mean 'stop'?"),
        ("pad_token_id", "batchgen pads nothing: give each row its own ids, unpadded, as 'prompt_token_ids'"),
        ("return_logprob", "did you mean 'logprobs'?"),
        ("logprob_start_len", "did you mean 'prompt_logprobs_from'?"),
        ("num_return_sequences", "did you mean 'n'?"),
        ("do_sample", "batchgen samples unless 'temperature' is 0: give temperature 0 for HF's do_sample false"),
        ("num_beams", "batchgen has no such option"),
    ):
        with pytest.raises(TypeError, match=re.escape(f"'{given}' ({said})") + "$"):
            generator.generate(["x"], **{given: 1})
    with pytest.raises(TypeError, match=re.escape("run(): dataset must be a path, got list (rows held in Python")):
        batchgen.run(["a", "b"], tmp_path / "out.jsonl")
    # A row field is a keyword of generate() (for every row), a file's row field for run(): each named so, not as a
    # near spelling of itself (found by a review).
    with pytest.raises(TypeError, match=re.escape("'regex' ('regex' is an option of generate() and stream())")):
        batchgen.Generator(str(chat_model), regex="x")
    with pytest.raises(TypeError, match=re.escape("'logit_bias' ('logit_bias' is a row field: give it in each row)")):
        batchgen.run(tmp_path / "in.jsonl", tmp_path / "out.jsonl", logit_bias={})
    with pytest.raises(TypeError, match=re.escape("'stop_strings' ('stop' is an option of generate() and stream())")):
        batchgen.Generator(str(chat_model), stop_strings=["x"])
    with pytest.raises(TypeError, match="run\\(\\) got an unexpected keyword argument 'bogus'"):
        batchgen.run(tmp_path / "in.jsonl", tmp_path / "out.jsonl", bogus=1)
    # Found by a vLLM user, whose SamplingParams(seed=) seeds each request: the row's seed is named too.
    with pytest.raises(TypeError, match=re.escape("('seed' is an option of Generator(); a row's own 'seed' seeds")):
        generator.generate(["x"], seed=3)
    # A switch takes booleans only (None where its default is decided at load): "false" is a true string. A bad
    # value, so a BatchgenError named by its flag, as other bad values (a new user met a TypeError for logprobs=1
    # beside a BatchgenError for top_k=1.5).
    with pytest.raises(BatchgenError, match="^--deterministic: must be True or False or None, got 'false'$"):
        batchgen.Generator(str(chat_model), deterministic="false")
    with pytest.raises(BatchgenError, match="^--prefix-cache: must be True or False, got 0$"):
        batchgen.run(tmp_path / "in.jsonl", tmp_path / "out.jsonl", prefix_cache=0)
    # vLLM's logprobs=N: what gives it here, as a row's message says (found by a vLLM user).
    hint = r" \(vLLM's logprobs=N is logprobs true with top_logprobs N\)$"
    with pytest.raises(BatchgenError, match="^--logprobs: must be True or False, got 1" + hint):
        generator.generate(["x"], logprobs=1)
    # Every option's type is checked where it is given (found by a helper: these ended in TypeErrors deep in a check).
    with pytest.raises(BatchgenError, match='^--max-running-requests: must be an integer, got "4"$'):
        batchgen.Generator(str(chat_model), max_running_requests="4")
    with pytest.raises(BatchgenError, match=r'^--prompt-column: must be a string, got \["q"\]$'):
        generator.generate([{"q": "x"}], prompt_column=["q"])
    with pytest.raises(BatchgenError, match=r"^--flush-every: must be an integer, got \[1\]$"):
        batchgen.run(tmp_path / "in.jsonl", tmp_path / "out.jsonl", flush_every=np.array([1]))
    with pytest.raises(BatchgenError, match="^--model: must be a string, got 123$"):
        batchgen.Generator(123)  # type: ignore[arg-type]
    with pytest.raises(BatchgenError, match=r"^--temperature: must be a finite number, got 1000"):
        generator.generate(["x"], temperature=10**400)
    with pytest.raises(BatchgenError, match=r"^--mem-fraction must be in \(0, 1\), got 2.0$"):
        batchgen.Generator(str(chat_model), mem_fraction=2.0)
    with pytest.raises(BatchgenError, match=r"^--temperature: must be a number in \[0, 10000\], got -1$"):
        generator.generate(["x"], temperature=-1)
    with pytest.raises(BatchgenError, match="^--on-error must be auto, fail or skip, got 'ignore'$"):
        generator.generate(["x"], on_error="ignore")
    with pytest.raises(RowError):  # auto writes error lines only to OpenAI Batch output: here it is fail
        generator.generate([{"prompt": "x", "temperature": -1}], on_error="auto")
    # A value of the wrong type: the message a row's field gets, not a TypeError from deep in a check.
    with pytest.raises(BatchgenError, match='^--max-new-tokens: must be an integer, got "ten"$'):
        generator.generate(["x"], max_new_tokens="ten")
    with pytest.raises(BatchgenError, match='^--temperature: must be a number, got "hot"$'):
        batchgen.run(tmp_path / "in.jsonl", tmp_path / "out.jsonl", temperature="hot")
    with pytest.raises(BatchgenError, match=r"^--stop: must be a string or a list of strings, got \[5\]$"):
        generator.generate(["x"], stop=5)
    with pytest.raises(BatchgenError, match="^--n: must be an integer, got 2.0$"):
        generator.generate(["x"], n=2.0)
    # numpy's numbers are numbers (a value read from a DataFrame or computed with numpy).
    rows = generator.generate(["x"], max_new_tokens=np.int64(2), temperature=np.float32(0.5), top_k=np.int32(3))
    assert len(rows[0]["output_token_ids"]) <= 2
    # More samples than requests run at once: they run as groups (found by a vLLM user: refused before).
    assert [row["sample_index"] for row in generator.generate(["x"], n=5, max_new_tokens=2)] == [0, 1, 2, 3, 4]
    # ... in rows too, and a numpy array of token ids is a list of them (found by a new user: np.int64(3) as a row's
    # max_new_tokens was refused, and an array of prompt_token_ids ended in a numpy broadcasting error).
    # Sampled: ignore_eos, as the 3 tokens are counted (a seed's draws are another CPU's own, an early EOS too).
    plain = {"id": 7, "prompt_token_ids": [9, 8, 7], "max_new_tokens": 3, "temperature": 0.5, "seed": 1}
    plain["ignore_eos"] = True
    numpy_row = {"id": np.int64(7), "prompt_token_ids": np.array([9, 8, 7]), "max_new_tokens": np.int64(3)}
    numpy_row |= {"temperature": np.float32(0.5), "seed": np.int32(1), "logprobs": np.bool_(True)}
    numpy_row["ignore_eos"] = np.bool_(True)
    got, want = generator.generate([numpy_row]), generator.generate([plain | {"logprobs": True}])
    _assert_same_results(got, want)
    assert got[0]["id"] == "7" and len(got[0]["output_token_ids"]) == 3
    greedy = {"max_new_tokens": 2, "temperature": 0.0}
    bare = generator.generate([np.array([9, 8, 7]), [np.int64(9), np.int64(8), np.int64(7)]], **greedy)
    [plain_ids] = generator.generate([[9, 8, 7]], **greedy)
    assert bare[0]["output_token_ids"] == bare[1]["output_token_ids"] == plain_ids["output_token_ids"]
    # A DataFrame's messages column holds numpy object arrays (pandas' read_parquet, a numpy-format dataset); stop
    # strings and switches may be numpy values too.
    chat = [{"role": "user", "content": "Hi"}]
    as_array = {"messages": np.array(chat, dtype=object), "stop": np.array(["\n\n"])}
    got = generator.generate([as_array], logprobs=np.bool_(True), **greedy)
    _assert_same_results(got, generator.generate([{"messages": chat, "stop": ["\n\n"]}], logprobs=True, **greedy))
    # A message's content parts read from a Parquet list-of-struct column are object arrays inside the object array
    # (found by a review: "'content' must be a string, got ndarray").
    parts = np.array([{"type": "text", "text": "Hi"}], dtype=object)
    nested = {"messages": np.array([{"role": "user", "content": parts}], dtype=object)}
    _assert_same_results(generator.generate([nested], **greedy), generator.generate([{"messages": chat}], **greedy))
    # A list option's items too: the run's metadata records them as JSON.
    args = (tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    write_jsonl(args[0], [{"prompt_token_ids": [9, 8, 7]}])
    run_options = {"max_new_tokens": 2, "progress": False, "overwrite": True, **ENGINE}
    batchgen.run(*args, model=str(chat_model), stop_token_ids=[np.int64(3)], **run_options)
    # A path or a torch.device is its text, a long double its float, None an option's default (a config's null).
    engine = {**ENGINE, "device": torch.device("cpu")}
    batchgen.run(*args, model=chat_model, temperature=np.longdouble(0.5), stop=None, **run_options | engine)
    assert len(read_rows(args[1])) == 1


def test_run_writes_what_batchgen_run_writes_and_resumes(chat_model: Path, tmp_path: Path) -> None:
    rows = [{"prompt": "Once upon a time"}, {"prompt": "The cat", "n": 2}, {"id": "t", "prompt_token_ids": [9, 8]}]
    rows.append({"prompt": "Numbers", "max_tokens": 2})
    options = {"model": str(chat_model), "max_new_tokens": 5, "progress": False, **ENGINE}
    cli_out = tmp_path / "cli.arrow"
    generate(write_jsonl(tmp_path / "all.jsonl", rows), cli_out, chat_model, "--max-new-tokens", "5", *ENGINE_FLAGS)
    dataset = write_jsonl(tmp_path / "in.jsonl", rows[:3])
    out = tmp_path / "api.arrow"

    first = batchgen.run(dataset, out, **options)
    write_jsonl(dataset, rows)  # a row more: the finished output lacks it
    second = batchgen.run(str(dataset), str(out), resume=True, **options)
    third = batchgen.run(dataset, out, resume=True, **options)

    assert (first.rows, first.samples, second.rows, third.rows) == (3, 4, 1, 0)
    got, expected = _samples(out), _samples(cli_out)
    assert got.keys() == expected.keys() == {("0", 0), ("1", 0), ("1", 1), ("t", 0), ("3", 0)}
    for key, row in got.items():
        # Logprobs to float32 rounding: the resumed row ran alone, not in the CLI's batch of four.
        assert row["output_logprobs"] == pytest.approx(expected[key]["output_logprobs"], rel=1e-5, abs=1e-5)
        del row["output_logprobs"], expected[key]["output_logprobs"]
        assert row == expected[key]


def test_run_that_fails_after_the_model_loads_leaves_the_output_free(chat_model: Path, tmp_path: Path) -> None:
    """Found by a review: a run that took the output's lock before loading the model and failed after it (a default
    the model's vocabulary refuses) kept the lock, and the caller's next try in the same process was refused as
    "another batchgen run is writing this output"."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Once upon a time"}])
    out = tmp_path / "out.arrow"
    partial_dir(out).mkdir()  # an earlier run's partial output: this run takes its lock before the model loads
    options = {"model": str(chat_model), "max_new_tokens": 2, "progress": False, "overwrite": True, **ENGINE}
    with pytest.raises(BatchgenError, match="^--top-logprobs: must be in"):
        batchgen.run(dataset, out, top_logprobs=10**6, **options)
    assert batchgen.run(dataset, out, **options).rows == 1


def test_run_takes_a_config_file_as_the_command_line_does(chat_model: Path, tmp_path: Path) -> None:
    """``config=`` reads the YAML that ``--config`` reads, keywords overriding it as flags do (found by a new user:
    a scheduled job's YAML had no way into ``batchgen.run``). The outputs and their recorded defaults agree."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Once upon a time"}, {"prompt": "The cat"}])
    config = tmp_path / "job.yaml"
    config.write_text("max-new-tokens: 6\ntemperature: 0.9\nstop: ['\\n']\nseed: 3\nignore_eos: true\n")
    cli_out, api_out = tmp_path / "cli.arrow", tmp_path / "api.arrow"
    flags = ["--config", str(config), "--temperature", "0.7", *ENGINE_FLAGS]
    generate(dataset, cli_out, chat_model, *flags)
    batchgen.run(dataset, api_out, config=config, temperature=0.7, model=str(chat_model), progress=False, **ENGINE)
    assert _samples(api_out) == _samples(cli_out)
    recorded = [read_results(path).schema.metadata[b"batchgen.sampling_defaults"] for path in (api_out, cli_out)]
    assert recorded[0] == recorded[1]
    assert json.loads(recorded[0])["stop"] == ["\n"] and json.loads(recorded[0])["temperature"] == 0.7
    config.write_text("max-new-tokns: 5\n")
    with pytest.raises(
        BatchgenError, match=rf"^{config}: unknown option 'max-new-tokns' \(did you mean 'max-new-tokens'\?\)$"
    ):
        batchgen.run(dataset, api_out, config=config, model=str(chat_model), overwrite=True)


@pytest.mark.parametrize(
    "lines",
    [
        "temperature: 1e-3\nmem-fraction: 5e-1",  # YAML reads 1e-3 (no dot) as text; click as a number
        "n: '2'\nmax-new-tokens: '3'\nseed: 5.0",
        "ignore-eos: 'true'\nprefix-cache: 0\ntop-p: '0.5'",
        "stop: ['a\\tb', x]\nstop-token-ids: 7",
        "stop: 5",
        "max-new-tokens: 2.5",
        "max-new-tokens: true",
        "seed: null\ntemperature: hot",
    ],
)
def test_a_config_file_means_the_same_to_run_and_to_the_command_line(
    chat_model: Path, tmp_path: Path, lines: str
) -> None:
    """Found by a review: YAML that ``--config`` took (``1e-3``, ``'2'``, ``5.0``, ``'true'``) was refused by
    ``config=``. Either both run with the same recorded settings, or both refuse the file, naming it; the file's
    dataset and out keys stand in for run's arguments, and a keyword of None leaves the file's value."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Once upon a time", "max_new_tokens": 2}])
    config = tmp_path / "job.yaml"
    cli_out, api_out = tmp_path / "cli.arrow", tmp_path / "api.arrow"
    config.write_text(f"{lines}\nmodel: {chat_model}\ndevice: cpu\ndtype: float32\nout: {api_out}\nprogress: false\n")
    # The seed given beside the file (a run without one draws its own): the samples must agree too.
    code, output = run_cli(["run", str(dataset), "--out", str(cli_out), "--config", str(config), "--seed", "3"])
    if code != 0:
        assert code == 2 and output.startswith(f"batchgen: error: {config}: option '"), output
        with pytest.raises(BatchgenError, match=f"^{config}: "):
            batchgen.run(dataset, config=config)
        return
    batchgen.run(dataset, config=config, seed=3, temperature=None)
    for key in (b"batchgen.sampling_defaults", b"batchgen.engine_options"):
        recorded = [read_results(path).schema.metadata.get(key) for path in (api_out, cli_out)]
        assert recorded[0] == recorded[1], key
    assert _samples(api_out) == _samples(cli_out)


def _samples(path: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """An output file's rows by (id, sample_index)."""
    return {(r["id"], r["sample_index"]): r for r in read_results(path).to_pylist()}


def test_run_with_bad_rows_raises_after_writing_the_good_ones(chat_model: Path, tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "fine"}, {"prompt": "bad", "top_k": -5}])
    out = tmp_path / "out.jsonl"
    options = {"model": str(chat_model), "max_new_tokens": 2, "progress": False, **ENGINE}
    with pytest.raises(BadRowsLeftOut, match="^1 bad input row left out") as info:
        batchgen.run(dataset, out, **options)
    assert (info.value.exit_status, info.value.summary.rows, info.value.summary.errors) == (3, 1, 1)
    again = pickle.loads(pickle.dumps(info.value))  # as a worker process hands it back (multiprocessing, Ray)
    assert (str(again), again.summary) == (str(info.value), info.value.summary)
    assert read_rows(out).keys() == {"0"}
    summary = batchgen.run(dataset, out, on_error="skip", overwrite=True, **options)
    assert (summary.rows, summary.errors) == (1, 1)
    assert read_rows(out)["1"]["finish_reason"] == "error"


def test_a_stop_signal_raises_run_interrupted_and_resume_finishes(
    chat_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchgen.loop.engine import Engine

    rows = [{"prompt": f"row {i}", "max_new_tokens": 1 + i % 3, "ignore_eos": True} for i in range(12)]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.arrow"
    options = {"model": str(chat_model), "progress": False, "flush_every": 1, **ENGINE, "max_running_requests": 2}
    step = Engine.step
    rounds = 0

    def step_then_interrupt(engine: Engine) -> list[Any]:
        nonlocal rounds
        rounds += 1
        if rounds == 3:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C would, in the middle of the run
        return step(engine)

    monkeypatch.setattr(Engine, "step", step_then_interrupt)
    caller_handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt) as stopped:
        batchgen.run(dataset, out, **options)
    monkeypatch.undo()

    assert isinstance(stopped.value, batchgen.RunInterrupted) and stopped.value.signal_name == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is caller_handler
    done = stopped.value.summary.rows
    assert 0 < done < 12 and stopped.value.partial_dir.is_dir() and not out.exists()
    resumed = batchgen.run(dataset, out, resume=True, **options)
    assert resumed.rows == 12 - done
    assert sorted(read_rows(out), key=int) == [str(i) for i in range(12)]


def test_import_batchgen_loads_no_torch() -> None:
    code = "import sys, batchgen; print('torch' in sys.modules, batchgen.__version__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", batchgen.__version__]


def test_a_call_that_draws_an_earlier_calls_seeds_again_is_warned(chat_model: Path) -> None:
    """Found by a vLLM user (helper 109), whose LLM(seed=0) draws new samples at every call: here the same sampled
    rows give the same samples again (the documented seeding: run seed and id), which a warning now says."""
    generator = batchgen.Generator(str(chat_model), **ENGINE)
    sampled = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither a first call, nor greedy rows, nor rows of their own seed warn
        first = generator.generate(["a b", "c d"], **sampled)
        generator.generate(["a b", "c d"], max_new_tokens=6, temperature=0)
        generator.generate([{"prompt": "a b", "seed": 3}], **sampled)
    with pytest.warns(UserWarning, match="row '0' draws with the seed a sampled row of an earlier call drew with"):
        again = generator.generate(["a b", "c d"], **sampled)
    assert [r["output_token_ids"] for r in again] == [r["output_token_ids"] for r in first]
    with pytest.warns(UserWarning, match="row '1' draws"):  # another prompt, at a position an earlier call used
        generator.generate([{"id": "new", "prompt": "e"}, "f g"], **sampled)
    # Found by helper 110: rows of a call that failed before generating, rows top_k 1 makes greedy, and rows a
    # stream read but never ran drew nothing.
    fresh = batchgen.Generator(str(chat_model), **ENGINE)
    with pytest.raises(RowError):
        fresh.generate(["a b", {"prompt": "c d", "temperature": "hot"}], **sampled)
    fresh.generate(["a b", "c d"], max_new_tokens=4, top_k=1)
    fresh.generate([{"prompt": "a b", "prompt_logprobs": 0}], max_new_tokens=0, temperature=1)  # scores, draws nothing
    long_row = {"id": "s0", "prompt": "a", "max_new_tokens": 30}  # still running when the stream is closed
    stream = fresh.stream([long_row, *[{"id": f"s{i}", "prompt": "b", "max_new_tokens": 1} for i in (1, 2)]], **sampled)
    assert next(stream)["id"] != "s0"
    stream.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.generate(["a b", "c d", {"id": "s0", "prompt": "z"}], **sampled)
    unseeded = batchgen.Generator(str(chat_model), **{**ENGINE, "seed": None})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # each call draws a run seed of its own
        for _ in range(2):
            unseeded.generate(["a b"], **sampled)
