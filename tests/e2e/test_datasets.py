"""Datasets as they are: Hugging Face ``save_to_disk`` directories, directories and globs of Parquet and JSONL shards,
their own column names (``--prompt-column``, ``--prompt-template``, ``--id-column``, ShareGPT ``conversations``).
The datasets are written by the ``datasets`` package itself; each generated text must equal the text of the same
prompt given as a plain ``prompt`` (or ``messages``) row, the path the other tests check against references."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict
from transformers import AutoTokenizer

from batchgen.io.writer import read_results
from tests.helpers.cli import generate, read_rows, run_args, run_cli, write_jsonl

GREEDY = ["--temperature", "0", "--ignore-eos", "--max-new-tokens", "4"]
QUESTIONS = [
    "Once upon a time",
    "The quick brown fox",
    "Numbers like 12345",
    "Café, naïve and jalapeño",
    "The cat sleeps by the fire",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def model(random_models: dict[str, Path]) -> Path:
    return random_models["llama"]


@pytest.fixture(scope="module")
def chat_model(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    chat = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(model, chat)
    tokenizer = AutoTokenizer.from_pretrained(chat)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(chat)
    return chat


def questions() -> Dataset:
    return Dataset.from_dict({"qid": [f"q{i}" for i in range(len(QUESTIONS))], "question": QUESTIONS})


def plain_texts(tmp_path: Path, model: Path, rows: list[dict[str, Any]]) -> dict[str, str]:
    """The greedy text of each row (rows with their own ``id``), run as a plain JSONL file."""
    out = generate(write_jsonl(tmp_path / "plain.jsonl", rows), tmp_path / "plain.arrow", model, *GREEDY)
    return {rid: row["text"] for rid, row in out.items()}


def test_save_to_disk_shards_with_a_prompt_column(model: Path, tmp_path: Path) -> None:
    questions().save_to_disk(str(tmp_path / "hf"), num_shards=2)
    assert sorted(p.name for p in (tmp_path / "hf").glob("*.arrow")) == [
        "data-00000-of-00002.arrow",
        "data-00001-of-00002.arrow",
    ]
    rows = generate(tmp_path / "hf", tmp_path / "out.arrow", model, "--prompt-column", "question", *GREEDY)
    # Ids are row indices that continue across the shards (3 rows, then 2), and `question` passes through.
    assert {rid: row["question"] for rid, row in rows.items()} == {str(i): q for i, q in enumerate(QUESTIONS)}
    want = plain_texts(tmp_path, model, [{"id": str(i), "prompt": q} for i, q in enumerate(QUESTIONS)])
    assert {rid: row["text"] for rid, row in rows.items()} == want
    assert all(row["completion_tokens"] == 4 for row in rows.values())


def test_a_glob_of_parquet_shards_with_a_template_and_an_id_column(model: Path, tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    for i in range(2):
        questions().shard(2, i, contiguous=True).to_parquet(str(tmp_path / "data" / f"train-{i}.parquet"))
    pattern = str(tmp_path / "data" / "train-*.parquet")
    template = "Question: {question}\\nAnswer:"  # as typed in a shell: a backslash and an n
    rows = generate(
        Path(pattern), tmp_path / "out.arrow", model, "--prompt-template", template, "--id-column", "qid", *GREEDY
    )
    want = plain_texts(
        tmp_path, model, [{"id": f"q{i}", "prompt": f"Question: {q}\nAnswer:"} for i, q in enumerate(QUESTIONS)]
    )
    assert {rid: row["text"] for rid, row in rows.items()} == want
    assert rows["q4"]["question"] == QUESTIONS[4] and rows["q4"]["qid"] == "q4"


def test_jsonl_shards_name_the_shard_and_line_of_a_bad_row(model: Path, tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    dataset = Dataset.from_dict({"question": [*QUESTIONS[:3], None, QUESTIONS[4]]})
    for i in range(2):
        dataset.shard(2, i, contiguous=True).to_json(str(tmp_path / "data" / f"part-{i}.jsonl"), lines=True)
    code, output = run_cli(
        run_args(tmp_path / "data", tmp_path / "out.arrow", model, "--prompt-column", "question", *GREEDY)
    )
    assert code == 3, output
    shard = tmp_path / "data" / "part-1.jsonl"
    assert (
        f"batchgen: error: {shard}:1: field 'question': null or missing; --prompt-column question needs a value in "
        "every row"
    ) in output
    assert sorted(read_rows(tmp_path / "out.arrow")) == ["0", "1", "2", "4"]


def test_a_duplicate_id_names_the_id_column(model: Path, tmp_path: Path) -> None:
    rows = [{"key": "a", "question": QUESTIONS[0]}, {"key": "a", "question": QUESTIONS[1]}]
    dataset = write_jsonl(tmp_path / "data.jsonl", rows)
    options = ["--prompt-column", "question", "--id-column", "key", "--on-error", "skip", *GREEDY]
    code, output = run_cli(run_args(dataset, tmp_path / "out.jsonl", model, *options))
    assert code == 0, output
    # The row error names the column the id came from, as every row error of a mapped field does.
    assert f"{dataset}:2: field 'key': duplicate id 'a'" in output
    errors = [line["error"] for line in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())]
    assert sorted(errors, key=str) == [f"{dataset}:2: field 'key': duplicate id 'a'", None]  # the first row is done


def test_a_column_of_a_later_shard_is_the_datasets(model: Path, tmp_path: Path) -> None:
    """Shards are one dataset: a ``prompt`` column only the second shard has is refused as the first shard's is (it
    was replaced unseen, and the refusal depended on the shards' names; helper 63)."""
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"question": [QUESTIONS[0]], "qid": ["q1"]}), tmp_path / "data" / "train-0.parquet")
    second = {"question": [QUESTIONS[1]], "qid": ["q2"], "prompt": ["another prompt"]}
    pq.write_table(pa.table(second), tmp_path / "data" / "train-1.parquet")
    args = run_args(tmp_path / "data", tmp_path / "out.arrow", model, "--prompt-column", "question")
    assert _error(args) == (
        f"{tmp_path / 'data'}: the dataset has its own 'prompt' column, which --prompt-column question would replace; "
        "rename that column, or leave the option out to use it"
    )


def test_a_row_without_its_id_column_value_claims_no_id(model: Path, tmp_path: Path) -> None:
    """With --id-column a row must hold an id: one without is a bad row whose index is no id of its (the rule that a
    row takes its index as id is the ``id`` field's), so the row whose key is 0 is not a duplicate (helper 63)."""
    rows = [{"key": None, "question": QUESTIONS[0]}, {"key": 0, "question": QUESTIONS[1]}]
    dataset = write_jsonl(tmp_path / "data.jsonl", rows)
    options = ["--prompt-column", "question", "--id-column", "key", "--on-error", "skip", *GREEDY]
    code, output = run_cli(run_args(dataset, tmp_path / "out.jsonl", model, *options))
    assert code == 0, output
    assert "duplicate" not in output
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted((line["id"], (line["error"] or "").split(": ")[-1]) for line in lines) == [
        ("0", ""),
        ("null", "null or missing; --id-column key needs a value in every row"),  # its id as it is, as a bad id's
    ]


def test_an_unreadable_line_claims_no_id_with_an_id_column(model: Path, tmp_path: Path) -> None:
    """With --id-column an unreadable line's error row is called ``null``, as a row whose id column is null: its
    index (1) is the id of another row, which was written beside it twice over, and status counted it once."""
    dataset = tmp_path / "data.jsonl"
    good = [json.dumps({"key": key, "question": q}) for key, q in ((0, QUESTIONS[0]), (1, QUESTIONS[1]))]
    dataset.write_text("\n".join([good[0], "{not json", good[1]]) + "\n")
    options = ["--prompt-column", "question", "--id-column", "key", "--on-error", "skip", *GREEDY]
    out = tmp_path / "out.jsonl"
    code, output = run_cli(run_args(dataset, out, model, *options))
    assert code == 0, output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((line["id"], line["error"] is None) for line in lines) == [("0", True), ("1", True), ("null", False)]
    code, output = run_cli(["status", str(dataset), str(out), "--id-column", "key", "--prompt-column", "question"])
    assert code == 0, output
    assert "3 of 3 rows done, 0 remaining, 1 errored" in output


def test_an_unreadable_line_claims_no_id_without_an_id_column(model: Path, tmp_path: Path) -> None:
    """An unreadable line's own id is unknown (here 7): its error row is called ``null``, as with --id-column, and
    a later row whose id is the line's index (1) is generated, not refused as a duplicate of it (found by a helper:
    the good row was lost); status counts all three rows done."""
    dataset = tmp_path / "data.jsonl"
    good = [json.dumps({"id": rid, "prompt": q}) for rid, q in ((0, QUESTIONS[0]), (1, QUESTIONS[1]))]
    dataset.write_text("\n".join([good[0], '{"id": 7, "prompt": "x"', good[1]]) + "\n")
    out = tmp_path / "out.arrow"
    code, output = run_cli(run_args(dataset, out, model, "--on-error", "skip", *GREEDY))
    assert code == 0 and "duplicate" not in output, output
    rows = sorted((r["id"], r["finish_reason"] == "error") for r in read_results(out).to_pylist())
    assert rows == [("0", False), ("1", False), ("null", True)]
    code, output = run_cli(["status", str(dataset), str(out)])
    assert code == 0 and "3 of 3 rows done, 0 remaining, 1 errored" in output, output


def test_resume_refuses_a_changed_row_whose_id_is_null_text(model: Path, tmp_path: Path) -> None:
    """A row whose id is the text "null" is its own row, after an unreadable line or a row with a null id (whose error
    rows are called null): not a duplicate when the run reads it, and checked for changes when --resume does (the
    changed row's stale text was kept; helper 65)."""
    dataset, out = tmp_path / "data.jsonl", tmp_path / "out.arrow"
    rows = [
        "not json",
        {"qid": None, "prompt": "x"},
        {"qid": "null", "prompt": QUESTIONS[0]},
        {"qid": "a", "prompt": "b"},
    ]

    def write(rows: list[Any]) -> None:
        dataset.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")

    write(rows)
    options = ["--id-column", "qid", "--on-error", "skip", *GREEDY]
    generate(dataset, out, model, *options)
    written = sorted((row["id"], row["finish_reason"]) for row in read_results(out).to_pylist())
    assert written == [("a", "length"), ("null", "error"), ("null", "error"), ("null", "length")]
    write([*rows[:2], {"qid": "null", "prompt": QUESTIONS[1]}, *rows[3:]])
    code, output = run_cli(["status", str(dataset), str(out), "--id-column", "qid"])
    assert "changed" in output, output
    code, output = run_cli([a for a in run_args(dataset, out, model, *options) if a != "--overwrite"] + ["--resume"])
    assert code == 2, output
    assert "('null')" in output, output


def test_resume_takes_an_edited_row_with_a_null_id(model: Path, tmp_path: Path) -> None:
    """Editing a row whose --id-column id is null (an error row) changes no row: the row whose id is the text "null"
    after it is the one compared (--resume refused it as changed; helper 66)."""
    dataset, out = tmp_path / "data.jsonl", tmp_path / "out.arrow"
    rows = [{"qid": None, "prompt": "x"}, {"qid": "null", "prompt": QUESTIONS[0]}, {"qid": "a", "prompt": "b"}]
    write_jsonl(dataset, rows)
    options = ["--id-column", "qid", "--on-error", "skip", *GREEDY]
    generate(dataset, out, model, *options)
    write_jsonl(dataset, [{"qid": None, "prompt": "y"}, *rows[1:]])
    code, output = run_cli([a for a in run_args(dataset, out, model, *options) if a != "--overwrite"] + ["--resume"])
    assert code == 0, output
    written = sorted((row["id"], row["finish_reason"]) for row in read_results(out).to_pylist())
    assert written == [("a", "length"), ("null", "error"), ("null", "length")]


def test_resume_refuses_a_duplicate_become_the_row_of_its_id(model: Path, tmp_path: Path) -> None:
    """Two rows with id x (the second a duplicate, an error row): the first deleted, the second is now x's row, whose
    result the output does not hold. --resume refuses it as changed (it found the duplicate's digest among those
    recorded, kept the first row's result and called the output complete; helper 67)."""
    dataset, out = tmp_path / "data.jsonl", tmp_path / "out.arrow"
    rows = [{"id": "x", "prompt": QUESTIONS[0]}, {"id": "x", "prompt": QUESTIONS[1]}, {"id": "y", "prompt": "b"}]
    write_jsonl(dataset, rows)
    generate(dataset, out, model, "--on-error", "skip", *GREEDY)
    write_jsonl(dataset, rows[1:])
    code, output = run_cli(
        [a for a in run_args(dataset, out, model, "--on-error", "skip", *GREEDY) if a != "--overwrite"] + ["--resume"]
    )
    assert code == 2, output
    assert f"cannot resume: the input of 1 row of {out} changed in {dataset}" in output, output


@pytest.mark.parametrize("case", ["unreadable", "deleted"])
def test_resume_refuses_an_id_whose_row_is_no_longer_one(model: Path, tmp_path: Path, case: str) -> None:
    """The output's result for an id was made from a row the dataset no longer has: row 1 (its index its id) turned
    into a line that is not JSON, or row "true" deleted while a row whose id is the bad value true (an error row
    called "true", claiming no id) stays. --resume refused neither and kept the result (helper 68)."""
    dataset, out = tmp_path / "data.jsonl", tmp_path / "out.arrow"
    if case == "unreadable":
        rows = [json.dumps({"prompt": QUESTIONS[i]}) for i in range(3)]
        edited, stale = [rows[0], rows[1][:-1], rows[2]], "1"
    else:
        rows = [json.dumps({"id": rid, "prompt": q}) for rid, q in (("a", "x"), ("true", QUESTIONS[0]), (True, "y"))]
        edited, stale = [rows[0], rows[2]], "true"
    dataset.write_text("\n".join(rows) + "\n")
    options = ["--on-error", "skip", *GREEDY]
    generate(dataset, out, model, *options)
    dataset.write_text("\n".join(edited) + "\n")
    code, output = run_cli(["status", str(dataset), str(out)])
    assert code == 1 and "1 row of" in output and "changed in" in output, output
    code, output = run_cli([a for a in run_args(dataset, out, model, *options) if a != "--overwrite"] + ["--resume"])
    assert code == 2, output
    assert (
        f"cannot resume: the input of 1 row of {out} changed in {dataset} or left it since it was made ('{stale}')"
        in output
    )


def test_sharegpt_conversations_are_read_as_messages(chat_model: Path, tmp_path: Path) -> None:
    conversations = [
        [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": question},
            {"from": "gpt", "value": "a reference answer, dropped"},
        ]
        for question in QUESTIONS[:3]
    ]
    Dataset.from_dict({"conversations": conversations}).save_to_disk(str(tmp_path / "hf"), num_shards=2)
    rows = generate(tmp_path / "hf", tmp_path / "out.arrow", chat_model, *GREEDY)
    messages = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
        for question in QUESTIONS[:3]
    ]
    want = plain_texts(tmp_path, chat_model, [{"id": str(i), "messages": m} for i, m in enumerate(messages)])
    assert {rid: row["text"] for rid, row in rows.items()} == want
    # The source column passes through whole, the reference answer too.
    assert rows["2"]["conversations"][-1] == {"from": "gpt", "value": "a reference answer, dropped"}


def test_resume_adds_the_rows_of_an_added_shard(model: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    questions().select(range(3)).to_parquet(str(data / "part-0.parquet"))
    out = tmp_path / "out.arrow"
    first = generate(data, out, model, "--prompt-column", "question", "--id-column", "qid", *GREEDY)
    assert sorted(first) == ["q0", "q1", "q2"]
    questions().select(range(3, 5)).to_parquet(str(data / "part-1.parquet"))
    code, output = run_cli(["status", str(data), str(out)])
    assert code == 1, output  # rows remain
    assert f"{out}: finished with rows missing: 3 of 5 rows done, 2 remaining, 0 errored" in output
    assert "shards added: part-1.parquet" in output
    args = run_args(data, out, model, "--prompt-column", "question", "--id-column", "qid", *GREEDY)
    code, output = run_cli([a for a in args if a != "--overwrite"] + ["--resume"])
    assert code == 0, output
    rows = read_rows(out)
    assert sorted(rows) == [f"q{i}" for i in range(5)]
    assert {rid: rows[rid]["text"] for rid in first} == {rid: row["text"] for rid, row in first.items()}
    want = plain_texts(tmp_path, model, [{"id": f"q{i}", "prompt": q} for i, q in enumerate(QUESTIONS)])
    assert {rid: row["text"] for rid, row in rows.items()} == want


def test_resume_refuses_a_changed_shard(model: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        questions().shard(2, i, contiguous=True).to_parquet(str(data / f"part-{i}.parquet"))
    out = tmp_path / "out.arrow"
    generate(data, out, model, "--prompt-column", "question", *GREEDY)
    changed = questions().shard(2, 1, contiguous=True).map(lambda row: {"question": row["question"] + "!"})
    changed.to_parquet(str(data / "part-1.parquet"))
    args = run_args(data, out, model, "--prompt-column", "question", *GREEDY)
    code, output = run_cli([a for a in args if a != "--overwrite"] + ["--resume"])
    assert code == 2, output
    assert f"cannot resume: the input of 2 rows of {out} changed in {data}" in output


def _error(args: list[str]) -> str:
    """The one line a run that fails before any row prints."""
    code, output = run_cli(args)
    assert code == 2, output
    lines = [line for line in output.splitlines() if line.startswith("batchgen: error:")]
    assert len(lines) == 1, output
    return lines[0].removeprefix("batchgen: error: ")


def test_dataset_errors_are_one_line_before_any_row(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.arrow"
    hf = tmp_path / "hf"
    questions().save_to_disk(str(hf), num_shards=2)
    # Named by the dataset, whose shards' columns together are its columns.
    assert _error(run_args(hf, out, model, "--prompt-column", "prompt")) == (
        f"{hf}: --prompt-column prompt: no column 'prompt' (it has 'qid', 'question')"
    )
    assert _error(run_args(hf, out, model, "--prompt-template", "Q: {question} {answer}")) == (
        f"{hf}: --prompt-template: no column 'answer' (it has 'qid', 'question')"
    )
    assert _error(run_args(hf, out, model, "--prompt-template", "Q: {question")) == (
        "--prompt-template 'Q: {question': expected '}' before end of string (a literal brace is {{ or }})"
    )
    assert _error(run_args(hf, out, model, "--prompt-template", "Q: {}")) == (
        "--prompt-template 'Q: {}': name a column in each field, as {question}"
    )
    assert _error(run_args(hf, out, model, "--prompt-column", "question", "--prompt-template", "{question}")) == (
        "--prompt-column and --prompt-template exclude each other: give one way to make the prompt"
    )
    DatasetDict({"train": questions(), "test": questions()}).save_to_disk(str(tmp_path / "dd"))
    assert _error(run_args(tmp_path / "dd", out, model)) == (
        f"{tmp_path / 'dd'}: is a DatasetDict with splits test, train; pass one split's directory, as "
        f"{tmp_path / 'dd' / 'test'}"
    )
    (tmp_path / "empty").mkdir()
    assert _error(run_args(tmp_path / "empty", out, model)) == (
        f"{tmp_path / 'empty'}: the directory holds no .jsonl, .parquet or .arrow files"
    )
    assert _error(run_args(tmp_path / "empty" / "*.parquet", out, model)) == (
        f"{tmp_path / 'empty' / '*.parquet'}: the pattern matches no file"
    )
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    questions().to_parquet(str(mixed / "a.parquet"))
    questions().to_json(str(mixed / "b.jsonl"), lines=True)
    assert _error(run_args(mixed, out, model)) == (
        f"{mixed}: mixes jsonl and parquet shards (b.jsonl, a.parquet); pass a glob that picks one kind, as "
        "DIR/*.parquet"
    )
    assert _error(run_args(mixed, mixed / "out.parquet", model)) == (
        f"{mixed / 'out.parquet'}: a later run would read the output as a shard of {mixed}; write it elsewhere"
    )
    clash = tmp_path / "clash"
    clash.mkdir()
    pq.write_table(pa.table({"prompt": ["a"], "score": [1]}), clash / "0.parquet")
    pq.write_table(pa.table({"prompt": ["b"], "score": ["high"]}), clash / "1.parquet")
    assert _error(run_args(clash, out, model)) == (
        f"shards disagree on column 'score': int64 in {clash / '0.parquet'}, string in {clash / '1.parquet'}"
    )
    assert not out.exists()


def test_config_keys_and_a_messages_column_of_role_content_items(chat_model: Path, tmp_path: Path) -> None:
    chats = [
        [{"role": "user", "content": question}, {"role": "assistant", "content": "ref"}] for question in QUESTIONS[:2]
    ]
    Dataset.from_dict({"chat": chats, "qid": ["a", "b"]}).to_parquet(str(tmp_path / "chats.parquet"))
    config = tmp_path / "c.yaml"
    config.write_text("messages-column: chat\nid-column: qid\n")
    rows = generate(tmp_path / "chats.parquet", tmp_path / "out.arrow", chat_model, "--config", str(config), *GREEDY)
    want = plain_texts(
        tmp_path, chat_model, [{"id": rid, "messages": chat[:1]} for rid, chat in zip(["a", "b"], chats, strict=True)]
    )
    assert {rid: row["text"] for rid, row in rows.items()} == want


def test_a_template_from_a_config_file_in_either_yaml_quoting(model: Path, tmp_path: Path) -> None:
    questions().to_json(str(tmp_path / "q.jsonl"), lines=True)
    want = plain_texts(tmp_path, model, [{"id": str(i), "prompt": f"Q: {q}\nA:"} for i, q in enumerate(QUESTIONS)])
    # YAML's double quotes make the newline; in single quotes \n stays two characters, which batchgen reads as one.
    for line in ['prompt-template: "Q: {question}\\nA:"\n', "prompt-template: 'Q: {question}\\nA:'\n"]:
        config = tmp_path / "c.yaml"
        config.write_text(line)
        rows = generate(tmp_path / "q.jsonl", tmp_path / "out.arrow", model, "--config", str(config), *GREEDY)
        assert {rid: row["text"] for rid, row in rows.items()} == want, line


def test_resume_with_other_column_options_says_so(model: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    questions().select(range(3)).to_parquet(str(data / "part-0.parquet"))
    out = tmp_path / "out.arrow"
    generate(data, out, model, "--prompt-column", "question", *GREEDY)
    # A finished output that holds every row is complete whatever the options (as with other sampling defaults);
    # one that lacks rows is checked row by row, and the rows it has were made from other prompts.
    questions().select(range(3, 5)).to_parquet(str(data / "part-1.parquet"))
    args = run_args(data, out, model, "--prompt-template", "Q: {question}", *GREEDY)
    code, output = run_cli([a for a in args if a != "--overwrite"] + ["--resume"])
    assert code == 2, output
    assert (
        f"cannot resume: the input of 3 rows of {out} changed in {data} or left it since it was made ('0', '1', '2'), "
        "read with other column options (prompt_column 'question' → not given; prompt_template not given → "
        "'Q: {question}'); --resume does not generate them again"
    ) in output


def test_batchgen_run_from_python_takes_the_column_options(model: Path, tmp_path: Path) -> None:
    import batchgen

    questions().save_to_disk(str(tmp_path / "hf"), num_shards=2)
    out = tmp_path / "py.jsonl"
    summary = batchgen.run(
        tmp_path / "hf",
        out,
        model=str(model),
        dtype="float32",
        device="cpu",
        prompt_template="Q: {question}\\nA:",
        id_column="qid",
        temperature=0.0,
        ignore_eos=True,
        max_new_tokens=4,
        progress=False,
    )
    assert summary.rows == len(QUESTIONS)
    want = plain_texts(tmp_path, model, [{"id": f"q{i}", "prompt": f"Q: {q}\nA:"} for i, q in enumerate(QUESTIONS)])
    assert {rid: row["text"] for rid, row in read_rows(out).items()} == want


def test_a_template_column_named_like_a_sampling_field_is_warned_about(model: Path, tmp_path: Path) -> None:
    Dataset.from_dict({"question": ["a?", "b?"], "n": [1, 2]}).to_json(str(tmp_path / "qs.jsonl"))
    args = run_args(tmp_path / "qs.jsonl", tmp_path / "out.arrow", model, "--prompt-template", "{n}: {question}")
    code, output = run_cli([*args, *GREEDY])
    assert code == 0, output
    assert "column 'n', named by the column options, is also the sampling field 'n'" in output
    rows = read_results(tmp_path / "out.arrow").to_pylist()
    assert sorted((r["id"], r["sample_index"]) for r in rows) == [("0", 0), ("1", 0), ("1", 1)]  # n read per row
