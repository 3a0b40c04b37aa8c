"""The dataset side of the reader: shards (directories, globs, Arrow files), the column options and their checks,
ShareGPT conversations, and the fingerprint of a dataset of shards."""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.errors import BatchgenError, RowError
from batchgen.io.columns import ColumnMapping, chat_messages
from batchgen.io.fingerprint import DatasetFingerprint, fingerprint_dataset
from batchgen.io.input_options import InputOptions
from batchgen.io.passthrough import SchemaInference, passthrough_names
from batchgen.io.reader import InputRow, RowReader, count_input_rows
from batchgen.io.rows import parse_row
from batchgen.io.shards import is_read_as_shard, list_shards
from batchgen.job.resume import check_output_path


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def rows_of(reader: RowReader) -> list[InputRow]:
    items = list(reader)
    assert all(isinstance(item, InputRow) for item in items), items
    return [item for item in items if isinstance(item, InputRow)]


# --- shards -----------------------------------------------------------------------------------------------


def test_jsonl_shards_continue_indices_and_share_one_schema(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "b.jsonl", ["", '{"prompt": "c", "k": 3}', '{"prompt": "d", "k": 4.5, "late": [1]}'])
    write_jsonl(tmp_path / "a.jsonl", ['{"prompt": "a", "k": 1}', '{"prompt": "b", "tag": "x"}'])
    # Blocks of three rows: both of a.jsonl and the first of b.jsonl, then b.jsonl's last, whose `k` widens the
    # type to double and whose `late` gets a column too.
    reader = RowReader(tmp_path, block_rows=3)
    assert reader.passthrough_schema == pa.schema(
        [pa.field("k", pa.float64()), pa.field("tag", pa.string()), pa.field("late", pa.list_(pa.int64()))]
    )
    got = [(r.index, r.source, r.line, r.data["prompt"]) for r in rows_of(reader)]
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    assert got == [(0, a, 1, "a"), (1, a, 2, "b"), (2, b, 2, "c"), (3, b, 3, "d")]
    assert [r.index for r in rows_of(reader)] == [0, 1, 2, 3]  # a second pass reads the same
    assert count_input_rows(tmp_path) == 4


def test_parquet_shards_unify_and_lack_columns(tmp_path: Path) -> None:
    pq.write_table(
        pa.table({"prompt": ["a", "b"], "score": pa.array([None, None], pa.int64())}), tmp_path / "0.parquet"
    )
    pq.write_table(pa.table({"prompt": ["c"], "score": [7], "note": ["n"]}), tmp_path / "1.parquet")
    reader = RowReader(Path(str(tmp_path / "*.parquet")), block_rows=1)
    assert reader.passthrough_schema.names == ["score", "note"]
    got = [(r.index, Path(r.source).name, r.line, r.data) for r in rows_of(reader)]
    assert got == [
        (0, "0.parquet", 1, {"prompt": "a"}),
        (1, "0.parquet", 2, {"prompt": "b"}),
        (2, "1.parquet", 1, {"prompt": "c", "score": 7, "note": "n"}),
    ]


def test_shards_of_types_that_hold_the_same_values_widen(tmp_path: Path) -> None:
    """pandas writes large_string and pyarrow string, and an int32 column beside an int64 one: the dataset's column
    takes the type that holds both, as pyarrow's permissive promotion and ``datasets`` do (they were refused)."""
    pq.write_table(
        pa.table({"prompt": ["a"], "score": pa.array([1], pa.int32()), "tag": ["x"]}), tmp_path / "0.parquet"
    )
    second = {"prompt": pa.array(["b"], pa.large_string()), "score": [2**40], "tag": pa.array(["y"], pa.large_string())}
    pq.write_table(pa.table(second), tmp_path / "1.parquet")
    reader = RowReader(tmp_path)
    promoted = pa.unify_schemas(
        [pq.read_schema(tmp_path / "0.parquet"), pq.read_schema(tmp_path / "1.parquet")], promote_options="permissive"
    )
    assert reader.passthrough_schema == pa.schema([promoted.field("score"), promoted.field("tag")])
    assert [r.data for r in rows_of(reader)] == [
        {"prompt": "a", "score": 1, "tag": "x"},
        {"prompt": "b", "score": 2**40, "tag": "y"},
    ]
    nested = tmp_path / "nested"
    nested.mkdir()
    first = {"prompt": ["a"], "tags": pa.array([["x"]], pa.list_(pa.string())), "m": [{"v": 1}]}
    pq.write_table(
        pa.table(
            first,
            schema=pa.schema(
                [("prompt", pa.string()), ("tags", pa.list_(pa.string())), ("m", pa.struct([("v", pa.int32())]))]
            ),
        ),
        nested / "0.parquet",
    )
    second = {"prompt": ["b"], "tags": pa.array([["y"]], pa.list_(pa.large_string())), "m": [{"v": 2**40, "w": "k"}]}
    pq.write_table(pa.table(second), nested / "1.parquet")
    widened = RowReader(nested).passthrough_schema
    assert widened.field("tags").type.value_type == pa.large_string()
    assert widened.field("m").type == pa.struct([("v", pa.int64()), ("w", pa.string())])
    pq.write_table(pa.table({"prompt": ["c"], "score": pa.array([3], pa.uint64())}), tmp_path / "2.parquet")
    with pytest.raises(BatchgenError, match=re.escape("shards disagree on column 'score': int64 in ")):
        RowReader(tmp_path)  # no integer type holds both int64's and uint64's values


def test_arrow_files_of_both_ipc_formats(tmp_path: Path) -> None:
    table = pa.table({"prompt": ["a", "b", "c"]})
    with pa.ipc.new_stream(tmp_path / "0.arrow", table.schema) as writer:  # Hugging Face's save_to_disk
        writer.write_table(table, max_chunksize=2)
    with pa.ipc.new_file(tmp_path / "1.arrow", table.schema) as file_writer:  # batchgen's outputs
        file_writer.write_table(table.slice(0, 1))
    reader = RowReader(tmp_path, block_rows=1)
    assert [(Path(r.source).name, r.line, r.data["prompt"]) for r in rows_of(reader)] == [
        ("0.arrow", 1, "a"),
        ("0.arrow", 2, "b"),
        ("0.arrow", 3, "c"),
        ("1.arrow", 1, "a"),
    ]
    assert count_input_rows(tmp_path) == 4


def test_a_directory_reads_data_files_only_and_a_glob_refuses_others(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", ['{"prompt": "a"}'])
    (tmp_path / "README.md").write_text("# a dataset\n")
    assert list_shards(tmp_path).paths == [tmp_path / "a.jsonl"]
    with pytest.raises(BatchgenError) as info:
        list_shards(Path(str(tmp_path / "*")))
    assert str(info.value) == (
        f"{tmp_path / '*'}: matches {tmp_path / 'README.md'}, which is not a .jsonl, .parquet or .arrow file; "
        "narrow the pattern"
    )


def test_a_shard_batchgen_cannot_read_is_an_error_not_passed_over(tmp_path: Path) -> None:
    """A link to a missing file (a half-downloaded hub snapshot's) and a compressed shard would leave their rows out
    unseen; ``datasets.load_dataset`` reads the compressed one (helper 63)."""
    write_jsonl(tmp_path / "train-0.jsonl", ['{"prompt": "a"}'])
    (tmp_path / "train-1.jsonl").symlink_to(tmp_path / "blobs" / "missing")
    for dataset in (tmp_path, Path(str(tmp_path / "*.jsonl"))):
        with pytest.raises(BatchgenError) as info:
            list_shards(dataset)
        assert str(info.value) == (
            f"{tmp_path / 'train-1.jsonl'}: cannot read: a link to {tmp_path / 'blobs' / 'missing'}, which does not "
            "exist"
        )
    (tmp_path / "train-1.jsonl").unlink()
    (tmp_path / "train-1.jsonl.gz").write_bytes(b"")
    with pytest.raises(BatchgenError) as info:
        list_shards(tmp_path)
    assert (
        str(info.value)
        == f"{tmp_path / 'train-1.jsonl.gz'}: a compressed shard, which batchgen does not read; decompress it"
    )


def test_an_empty_dataset_of_shards(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", [""])
    write_jsonl(tmp_path / "b.jsonl", ["  "])
    with pytest.raises(BatchgenError) as info:
        RowReader(tmp_path)
    assert str(info.value) == f"{tmp_path}: dataset is empty"


def test_outputs_that_a_later_run_would_read_as_shards(tmp_path: Path) -> None:
    assert is_read_as_shard(tmp_path, tmp_path / "out.parquet")
    assert not is_read_as_shard(tmp_path, tmp_path / "sub" / "out.parquet")
    assert is_read_as_shard(Path(str(tmp_path / "*.arrow")), tmp_path / "out.arrow")
    assert not is_read_as_shard(Path(str(tmp_path / "*.arrow")), tmp_path / "out.parquet")
    write_jsonl(tmp_path / "in.jsonl", ['{"prompt": "a"}'])
    assert not is_read_as_shard(tmp_path / "in.jsonl", tmp_path / "out.jsonl")


def test_a_glob_takes_the_output_as_glob_glob_would_read_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a review: the output was matched against the pattern as text, so `data/*.jsonl` did not take
    `--out ./data/out.jsonl` or its absolute path (a later run read the output as a shard), and took
    `data/sub/out.jsonl`, which it does not read. The reference is glob.glob itself, the output file made first."""
    monkeypatch.chdir(tmp_path)
    for folder in ("data/sub/deep", "data/.hidden", "other", "real"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    # Through symbolic links too (found by a helper): real/ld/.. is the folder above data, not real.
    (tmp_path / "real" / "ld").symlink_to("../data")
    (tmp_path / "data" / "lnk").symlink_to("../other")
    patterns = [
        "**/*.jsonl",
        "./**/*.jsonl",
        "real/ld/../data/*.jsonl",
        "real/*/*.jsonl",
        "d*/**/*.jsonl",
        "data/*.jsonl",
        "./data/*.jsonl",
        str(tmp_path / "data" / "*.jsonl"),
        "data/**/*.jsonl",
        "data/**",
        "data/*/*.jsonl",
        "other/../data/*.jsonl",
        "data/[ab]*.jsonl",
        "data/.*.jsonl",
        "d*/o*.jsonl",
    ]
    outs = [
        "data/out.jsonl",
        "./data/out.jsonl",
        str(tmp_path / "data" / "out.jsonl"),
        "data/sub/out.jsonl",
        "data/sub/deep/out.jsonl",
        "data/.hidden/out.jsonl",
        "data/.out.jsonl",
        "other/out.jsonl",
        "other/../data/b.jsonl",
        "data/out.parquet",
        "o.jsonl",
        str(tmp_path / "o.jsonl"),
        "data/new/out.jsonl",
        "data/new/.h/out.jsonl",
        "real/ld/new/out.jsonl",
    ]
    checked = 0
    for out in outs:
        # Asked before the output (and a folder it needs) exists, as a first run asks, and after, as --resume does.
        before = [is_read_as_shard(Path(pattern), Path(out)) for pattern in patterns]
        made = [folder for folder in reversed(Path(out).parents) if not folder.exists()]
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).touch()
        for pattern, answer in zip(patterns, before):
            taken = Path(out).resolve() in {Path(p).resolve() for p in glob.glob(pattern, recursive=True)}
            assert answer == is_read_as_shard(Path(pattern), Path(out)) == taken, (pattern, out)
            checked += taken
        Path(out).unlink()
        for folder in reversed(made):
            folder.rmdir()
    assert checked > 10  # both answers are exercised
    # The partial output's part files are shards of a glob that takes .arrow files (found by helpers: after a stop,
    # the next run read them as input, and --resume could not go on). Whatever name a part gets, a glob that lists
    # one is refused; one that cannot reach the folder or takes no .arrow name is not.
    for pattern in ["data/**/*.arrow", "data/**/*[1-9]*.arrow", "data/**/*[b-d]*", "**/*.arrow", "data/*/part-*"]:
        with pytest.raises(BatchgenError, match="would read the files of its partial output"):
            check_output_path(Path(pattern), Path("data/out.parquet"), overwrite=False, resume=False)
    for pattern in ["data/**/*.jsonl", "data/*.arrow", "other/**/*.arrow", "data/**/x.arrow"]:
        assert not check_output_path(Path(pattern), Path("data/out.parquet"), overwrite=False, resume=False)
    part = tmp_path / "data" / "out.parquet.partial" / "part-000003-9f86d081884c7d65.arrow"
    part.parent.mkdir()
    part.touch()
    for pattern in ["data/**/*.arrow", "data/**/*[1-9]*.arrow", "data/**/*[b-d]*", "**/*.arrow", "data/*/part-*"]:
        assert part.resolve() in {Path(p).resolve() for p in glob.glob(pattern, recursive=True)}, pattern


# --- column options ---------------------------------------------------------------------------------------


def test_template_escapes_and_fields() -> None:
    options = InputOptions(prompt_template="Q: {question}\\nA:\\t{n:03d} \\\\n {x!r}")
    assert options.template() == "Q: {question}\nA:\t{n:03d} \\n {x!r}"
    assert options.columns() == ["question", "n", "x"]
    mapping = ColumnMapping(options, ["question", "n", "x"], "d")
    data, _, problem = mapping.apply({"question": "why?", "n": 7, "x": "s"})
    assert problem is None and data["prompt"] == "Q: why?\nA:\t007 \\n 's'"
    # A non-string value is formatted as str() formats it; a null one is a row error naming its column.
    data, _, problem = ColumnMapping(InputOptions(prompt_template="{a}|{b}"), ["a", "b"], "d").apply(
        {"a": [1, 2], "b": 1.5}
    )
    assert problem is None and data["prompt"] == "[1, 2]|1.5"
    _, _, problem = ColumnMapping(InputOptions(prompt_template="{a}|{b}"), ["a", "b"], "d").apply({"a": "x"})
    assert problem == ("b", "null or missing; --prompt-template needs a value in every row")
    _, _, problem = mapping.apply({"question": "q", "n": "seven", "x": 1})
    assert problem == (
        "n",
        "--prompt-template cannot format it with '03d': Unknown format code 'd' for object of type 'str'",
    )


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("Q: {q", "expected '}' before end of string (a literal brace is {{ or }})"),
        ("Q: q}", "Single '}' encountered in format string (a literal brace is {{ or }})"),
        ("Q: {0}", "name a column in each field, as {question}"),
        ("Q: {!r}", "name a column in each field, as {question}"),
        ("Q: {a.b}", "field {a.b} must be a plain column name"),
        ("Q: {a[0]}", "field {a[0]} must be a plain column name"),
        ("Q: {a:{w}}", "a format spec cannot hold a field"),
        ("Q: {a!x}", "conversion !x is not !r, !s or !a"),
        ("Q: {{literal}}", "names no column; put one in braces, as {question}"),
    ],
)
def test_bad_templates_are_refused_before_any_row(template: str, message: str) -> None:
    with pytest.raises(BatchgenError) as info:
        InputOptions(prompt_template=template).validate()
    assert str(info.value) == f"--prompt-template {template!r}: {message}"


def test_options_exclude_each_other_and_name_columns() -> None:
    with pytest.raises(BatchgenError, match="^--messages-column and --prompt-template exclude each other"):
        InputOptions(messages_column="c", prompt_template="{q}").validate()
    with pytest.raises(BatchgenError, match="^--id-column: give a column name$"):
        InputOptions(id_column="").validate()


def test_a_column_the_dataset_has_under_batchgen_name_is_not_hidden() -> None:
    with pytest.raises(BatchgenError) as info:
        ColumnMapping(InputOptions(prompt_column="question"), ["question", "messages"], "d.parquet")
    assert str(info.value) == (
        "d.parquet: the dataset has its own 'messages' column, which --prompt-column question would replace; "
        "rename that column, or leave the option out to use it"
    )
    with pytest.raises(BatchgenError, match="own 'id' column, which --id-column qid would replace"):
        ColumnMapping(InputOptions(id_column="qid"), ["prompt", "id", "qid"], "d.parquet")
    # A template that uses the dataset's `prompt` column replaces it knowingly.
    data, _, _ = ColumnMapping(InputOptions(prompt_template="Q: {prompt}"), ["prompt"], "d").apply({"prompt": "p"})
    assert data["prompt"] == "Q: p"


def test_sharegpt_conversations_become_messages() -> None:
    conversation = [
        {"from": "system", "value": "s"},
        {"from": "human", "value": "h1"},
        {"from": "gpt", "value": "g1"},
        {"from": "human", "value": "h2"},
        {"from": "gpt", "value": "g2"},
        {"role": "assistant", "content": "g3"},
    ]
    assert chat_messages(conversation) == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "h1"},
        {"role": "assistant", "content": "g1"},
        {"role": "user", "content": "h2"},
    ]
    assert chat_messages([{"from": "tool", "value": "t"}]) == [{"role": "tool", "content": "t"}]
    assert chat_messages("not a list") == "not a list"


def parse(data: dict[str, Any], options: InputOptions, columns: list[str]) -> Any:
    mapped, fields, problem = ColumnMapping(options, columns, "d.jsonl").apply(data)
    row = InputRow(index=3, line=4, data=mapped, columns=fields, problem=problem)
    names = passthrough_names(columns)
    inference = SchemaInference()
    inference.add([data])
    return parse_row(row, "d.jsonl", inference.schema(names, lambda: [data]), names)


def test_conversations_are_picked_up_only_without_a_prompt_field() -> None:
    conversation = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ref"}]
    spec = parse({"conversations": conversation}, InputOptions(), ["conversations"])
    assert spec.messages == [{"role": "user", "content": "hi"}]
    assert not ColumnMapping(InputOptions(), ["conversations", "prompt"], "d").active
    with pytest.raises(RowError) as info:
        parse({"topic": "t"}, InputOptions(), ["conversations", "topic"])
    assert str(info.value) == (
        "d.jsonl:4: field 'conversations': null or missing; reading 'conversations' as the chat messages (the dataset "
        "has no prompt field) needs a value in every row"
    )


def test_row_errors_name_the_dataset_column() -> None:
    with pytest.raises(RowError) as info:
        parse({"question": 5}, InputOptions(prompt_column="question"), ["question"])
    assert str(info.value) == "d.jsonl:4: field 'question': must be a string, got number"
    with pytest.raises(RowError) as info:
        parse({"c": [{"from": "gpt", "value": "only"}]}, InputOptions(messages_column="c"), ["c"])
    assert str(info.value) == "d.jsonl:4: field 'c': holds only assistant turns: there is nothing to answer"
    with pytest.raises(RowError) as info:
        parse({"c": [{"from": "human"}]}, InputOptions(messages_column="c"), ["c"])
    assert str(info.value) == "d.jsonl:4: field 'c': item 0: 'content' must be a string, got null"
    spec = parse({"q": "a", "qid": 12}, InputOptions(prompt_column="q", id_column="qid"), ["q", "qid"])
    assert (spec.id, spec.prompt) == ("12", "a")


def test_a_missing_column_is_refused_with_the_columns_there(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", ['{"question": "a", "answer": "b"}'])
    with pytest.raises(BatchgenError) as info:
        RowReader(path, options=InputOptions(prompt_column="query"))
    assert str(info.value) == f"{path}: --prompt-column query: no column 'query' (it has 'question', 'answer')"


# --- fingerprint ------------------------------------------------------------------------------------------


def test_a_lone_file_fingerprint_keeps_its_format(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", ['{"prompt": "a"}'])
    recorded = json.loads(fingerprint_dataset(path).to_json())
    assert sorted(recorded) == ["mtime_ns", "sample_sha256", "size"]
    assert DatasetFingerprint.from_json(json.dumps(recorded)) == fingerprint_dataset(path)


def test_the_fingerprint_of_shards_names_each_change(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", ['{"prompt": "a"}'])
    write_jsonl(tmp_path / "b.jsonl", ['{"prompt": "b"}'])
    before = DatasetFingerprint.from_json(fingerprint_dataset(tmp_path).to_json())
    assert before.differences(fingerprint_dataset(tmp_path)) == []
    write_jsonl(tmp_path / "b.jsonl", ['{"prompt": "bb"}'])
    write_jsonl(tmp_path / "c.jsonl", ['{"prompt": "c"}'])
    (tmp_path / "a.jsonl").unlink()
    assert before.differences(fingerprint_dataset(tmp_path)) == [
        "shards added: c.jsonl",
        "shards removed: a.jsonl",
        "shard b.jsonl size 16 → 17 bytes",
    ]
    assert before.differences(fingerprint_dataset(tmp_path / "c.jsonl")) == [
        "dataset layout (one file ↔ a directory or glob of shards)"
    ]


def test_a_glob_names_its_shards_from_the_folder_before_its_first_wildcard(tmp_path: Path) -> None:
    """Found by a helper: a glob's shards were named from their common folder, so a shard added in another folder
    renamed the others ("shards added: a/x.jsonl, a/y.jsonl, b/z.jsonl; shards removed: x.jsonl, y.jsonl")."""
    for name in ("a/x.jsonl", "a/y.jsonl"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        write_jsonl(tmp_path / name, ['{"prompt": "a"}'])
    pattern = Path(str(tmp_path / "**" / "*.jsonl"))
    before = DatasetFingerprint.from_json(fingerprint_dataset(pattern).to_json())
    assert before.shards is not None and sorted(before.shards) == ["a/x.jsonl", "a/y.jsonl"]
    (tmp_path / "b").mkdir()
    write_jsonl(tmp_path / "b" / "z.jsonl", ['{"prompt": "z"}'])
    assert before.differences(fingerprint_dataset(pattern)) == ["shards added: b/z.jsonl"]
