"""Tests for batchgen.io: streaming input rows, row checks, and result writers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.errors import BatchgenError, RowError
from batchgen.io.arrow_fit import misfit
from batchgen.io.json_text import JSON_TEXT_METADATA
from batchgen.io.reader import InputRow, RowReader, count_input_rows
from batchgen.io.rows import RowSpec, parse_row, passthrough_that_fits
from batchgen.io.writer import OUTPUT_COLUMNS, is_json_text, open_result_writer, read_results, result_schema
from tests.helpers.cli import run_args, run_cli


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def read_all(reader: RowReader) -> list[InputRow | RowError]:
    return list(reader)


# --- reader: JSONL ---------------------------------------------------------------------------------------


def test_jsonl_blank_lines_counted_in_line_numbers_not_indices(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "in.jsonl", ['{"prompt": "a"}', "", "   ", '{"prompt": "b"}', '{"prompt": "c"}'])
    rows = read_all(RowReader(path))
    assert rows == [
        InputRow(index=0, line=1, data={"prompt": "a"}, source=str(path)),
        InputRow(index=1, line=4, data={"prompt": "b"}, source=str(path)),
        InputRow(index=2, line=5, data={"prompt": "c"}, source=str(path)),
    ]


def test_jsonl_streams_past_read_ahead_block_and_reiterates(tmp_path: Path) -> None:
    lines = [json.dumps({"prompt": f"p{i}"}) if i % 3 else "" for i in range(20)]
    path = write_lines(tmp_path / "in.jsonl", lines)
    reader = RowReader(path, block_rows=2)
    rows = read_all(reader)
    assert [(r.index, r.line, r.data["prompt"]) for r in rows if isinstance(r, InputRow)] == [
        (k, i + 1, f"p{i}") for k, i in enumerate(i for i in range(20) if i % 3)
    ]
    assert read_all(reader) == rows


def test_jsonl_invalid_json_yields_row_error_and_continues(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "in.json", ['{"prompt": "a"}', "", '{"prompt": "b",}', '{"prompt": "c"}'])
    rows = read_all(RowReader(path, block_rows=1))
    assert isinstance(rows[1], RowError)
    assert (rows[1].source, rows[1].line, rows[1].field) == (str(path), 3, None)
    assert rows[1].message.startswith("invalid JSON: Expecting property name enclosed in double quotes")
    assert str(rows[1]).startswith(f"{path}:3: invalid JSON:")
    # The bad line used index 1, so the next row keeps index 2.
    assert rows[2] == InputRow(index=2, line=4, data={"prompt": "c"}, source=str(path))


def test_jsonl_non_object_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "in.jsonl", ['{"prompt": "a"}', "[1, 2]", '"text"', "null", '{"prompt": "b"}'])
    rows = read_all(RowReader(path))
    errors = [r for r in rows if isinstance(r, RowError)]
    assert [(e.line, e.message) for e in errors] == [
        (2, "expected a JSON object, got array"),
        (3, "expected a JSON object, got string"),
        (4, "expected a JSON object, got null"),
    ]
    assert rows[4] == InputRow(index=4, line=5, data={"prompt": "b"}, source=str(path))


def test_jsonl_invalid_utf8_is_row_error(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    rows = read_all(RowReader(path))
    assert isinstance(rows[1], RowError)
    assert (rows[1].line, rows[1].message) == (2, "invalid UTF-8 at byte 13")


def test_jsonl_pretty_printed_document_fails_fast(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "in.json", ["[", '  {"prompt": "a"}', "]"])
    with pytest.raises(BatchgenError, match=r"in\.json:1: not a JSON object; this looks like a JSON document"):
        RowReader(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_dataset(tmp_path: Path, content: str) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(content)
    with pytest.raises(BatchgenError) as info:
        RowReader(path)
    assert str(info.value) == f"{path}: dataset is empty"


def test_empty_parquet_dataset(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    with pytest.raises(BatchgenError) as info:
        RowReader(path)
    assert str(info.value) == f"{path}: dataset is empty"


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(BatchgenError) as info:
        RowReader(tmp_path / "nope.jsonl")
    assert str(info.value) == f"{tmp_path / 'nope.jsonl'}: no such file"
    with pytest.raises(BatchgenError) as info:
        RowReader(tmp_path)
    assert str(info.value) == f"{tmp_path}: the directory holds no .jsonl, .parquet or .arrow files"


def test_unsupported_input_extension(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_text("prompt\nhello\n")
    with pytest.raises(BatchgenError) as info:
        RowReader(path)
    assert str(info.value) == f"{path}: unsupported input format '.csv' (use .jsonl, .parquet or .arrow)"


def test_not_a_parquet_file(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    path.write_text('{"prompt": "a"}\n')
    with pytest.raises(BatchgenError, match=r"in\.parquet: not a valid Parquet file"):
        RowReader(path)


# --- reader: Parquet --------------------------------------------------------------------------------------


def test_parquet_read_in_small_blocks(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    table = pa.table(
        {
            "prompt": [f"p{i}" for i in range(7)],
            "temperature": [None, 0.5, None, None, None, None, None],
            "text": ["t"] * 7,
            "score": pa.array(range(7), pa.int16()),
        }
    )
    pq.write_table(table, path, row_group_size=3)
    reader = RowReader(path, block_rows=2)
    assert reader.source == str(path)
    assert reader.passthrough_schema == pa.schema([("input_text", pa.string()), ("score", pa.int16())])
    rows = read_all(reader)
    assert [(r.index, r.line) for r in rows if isinstance(r, InputRow)] == [(i, i + 1) for i in range(7)]
    # Nulls are dropped, so an unset sampling field is absent rather than an explicit null.
    # A table's row is marked as one whose objects are structs (batchgen.io.chat_messages).
    assert rows[0] == InputRow(0, 1, {"prompt": "p0", "text": "t", "score": 0}, str(path), struct_nulls=True)
    assert rows[1] == InputRow(
        1, 2, {"prompt": "p1", "temperature": 0.5, "text": "t", "score": 1}, str(path), struct_nulls=True
    )


def test_renamed_fields_never_share_a_column(tmp_path: Path) -> None:
    """``error`` is an output column, so it passes through as ``input_error``; where the dataset has its own
    ``input_error`` too, that keeps its name and ``error`` takes one more ``input_``. Each field keeps its own
    column, in Parquet and in JSONL (in one row or in two); names that collide with nothing stay as they are."""
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "error": ["x"], "input_error": ["y"], "input_ids": ["z"]}), path)
    reader = RowReader(path)
    assert reader.passthrough_schema.names == ["input_input_error", "input_error", "input_ids"]
    assert read_all(reader)[0].data == {"prompt": "a", "error": "x", "input_error": "y", "input_ids": "z"}
    jsonl = write_lines(
        tmp_path / "in.jsonl", ['{"prompt": "a", "text": "x"}', '{"prompt": "b", "input_text": "y", "text": "z"}']
    )
    reader = RowReader(jsonl)
    schema = reader.passthrough_schema
    assert reader.passthrough_names == {"text": "input_input_text", "input_text": "input_text"}
    rows = [
        parse_row(r, str(jsonl), schema, reader.passthrough_names) for r in read_all(reader) if isinstance(r, InputRow)
    ]
    assert [r.passthrough for r in rows] == [
        {"input_input_text": "x", "input_text": None},
        {"input_input_text": "z", "input_text": "y"},
    ]
    alone = RowReader(write_lines(tmp_path / "alone.jsonl", ['{"prompt": "a", "input_text": "y", "error": 1}']))
    assert alone.passthrough_names == {"input_text": "input_text", "error": "input_error"}


def test_a_field_first_seen_in_a_later_block_gets_a_column_of_its_own(tmp_path: Path) -> None:
    """The schema is read from every row, not a first block: a later row's own ``input_text`` is a field of its
    own, and ``text`` (an output column's name) passes through as ``input_input_text`` in every row."""
    lines = ['{"prompt": "a", "text": "x"}', '{"prompt": "b", "input_text": "y"}']
    reader = RowReader(write_lines(tmp_path / "in.jsonl", lines), block_rows=1)
    assert reader.passthrough_names == {"text": "input_input_text", "input_text": "input_text"}
    specs = _parse_all(reader)
    assert [s.passthrough for s in specs if isinstance(s, RowSpec)] == [
        {"input_input_text": "x", "input_text": None},
        {"input_input_text": None, "input_text": "y"},
    ]


def test_parquet_of_many_small_groups_reads_every_row_once_and_names_a_damaged_group(tmp_path: Path) -> None:
    """Runs of row groups are read together (a read per group cost a fixed overhead each); a damaged group in the
    middle of a run, after rows of that run were given, still names its own first row, and no row comes twice."""
    from batchgen.io.table_shards import table_batches

    path = tmp_path / "in.parquet"
    ids = [f"r{i}" for i in range(70)]
    pq.write_table(pa.table({"id": ids, "prompt": ["x"] * 70}), path, row_group_size=7)
    assert pq.ParquetFile(path).num_row_groups == 10
    for block in (1, 5, 16, 1024):
        got = [i for batch in table_batches(path, "parquet", block) for i in batch.column("id").to_pylist()]
        assert got == ids, block
    column = pq.ParquetFile(path).metadata.row_group(5).column(0)  # rows 36-42 (1-based)
    data = bytearray(path.read_bytes())
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    for i in range(start, start + column.total_compressed_size):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    for block in (5, 16, 30, 1024):
        got = []
        with pytest.raises(BatchgenError, match=r"from row 36 on"):
            for batch in table_batches(path, "parquet", block):
                got += batch.column("id").to_pylist()
        assert got == ids[:35], block


def test_a_repeated_parquet_column_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    table = pa.Table.from_arrays([pa.array(["a"]), pa.array(["x1"]), pa.array(["x2"])], names=["prompt", "x", "x"])
    pq.write_table(table, path)
    with pytest.raises(BatchgenError, match=f"^{path}: column 'x' appears more than once; rename all but one$"):
        RowReader(path)


# --- reader: pass-through schema inference ----------------------------------------------------------------


def test_jsonl_passthrough_schema_inference(tmp_path: Path) -> None:
    rows = [
        {"id": 1, "prompt": "a", "temperature": 0.1, "topic": "x", "count": 1, "empty": None},
        {"prompt": "b", "count": 2.5, "tags": ["a"], "meta": {"k": 1}, "finish_reason": "mine", "nothing": []},
        {"prompt": "c", "later_in_block": True},
        {"prompt": "d", "after_block": 1},
    ]
    path = write_lines(tmp_path / "in.jsonl", [json.dumps(r) for r in rows])
    for block_rows in (1, 3, 1024):
        schema = RowReader(path, block_rows=block_rows).passthrough_schema
        assert schema == pa.schema(
            [
                ("topic", pa.string()),
                ("count", pa.float64()),
                ("empty", pa.string()),  # all null
                ("tags", pa.list_(pa.string())),
                ("meta", pa.struct([("k", pa.int64())])),
                ("input_finish_reason", pa.string()),  # collides with an output column
                ("nothing", pa.list_(pa.string())),  # only empty lists
                ("later_in_block", pa.bool_()),
                ("after_block", pa.int64()),
            ]
        ), block_rows


def _parse_all(reader: RowReader) -> list[RowSpec | RowError]:
    specs: list[RowSpec | RowError] = []
    for row in reader:
        assert isinstance(row, InputRow)
        try:
            specs.append(parse_row(row, reader.source, reader.passthrough_schema, reader.passthrough_names))
        except RowError as e:
            specs.append(e)
    return specs


def test_jsonl_mixed_types_pass_through_as_json_text(tmp_path: Path) -> None:
    """Values that share no Arrow type in the rows the schema comes from keep every row: the column holds each
    value's JSON text. Integers and floats share double; objects share a struct of all their keys."""
    rows = [
        {"prompt": "a", "x": 1, "score": 1, "meta": {"k": 1}, "tags": [{"a": 1}]},
        {"prompt": "b", "x": "two", "score": 2.5, "meta": {"k": 2, "j": 2}, "tags": [{"b": "s"}]},
        {"prompt": "c", "x": [3], "meta": {"j": "x"}},
    ]
    path = write_lines(tmp_path / "in.jsonl", [json.dumps(r) for r in rows])
    reader = RowReader(path)
    schema = reader.passthrough_schema
    assert [(f.name, str(f.type), is_json_text(f)) for f in schema] == [
        ("x", "string", True),
        ("score", "double", False),
        ("meta", "string", True),  # k is a number, j a number then a string
        ("tags", "list<item: struct<a: int64, b: string>>", False),
    ]
    specs = _parse_all(reader)
    assert all(isinstance(s, RowSpec) for s in specs)
    assert [s.passthrough["x"] for s in specs if isinstance(s, RowSpec)] == ["1", '"two"', "[3]"]
    assert [s.passthrough["meta"] for s in specs if isinstance(s, RowSpec)] == [
        '{"k": 1}',
        '{"k": 2, "j": 2}',
        '{"j": "x"}',
    ]


def _read_back(value: Any, field: pa.Field) -> Any:
    """A pass-through value as a reader of the output gets it back: JSON text decoded, typed values through Arrow."""
    if is_json_text(field):
        return json.loads(value)
    return pa.array([value], field.type).to_pylist()[0]


def test_jsonl_objects_of_other_blocks_share_a_struct_of_all_their_keys(tmp_path: Path) -> None:
    """Objects with keys first seen in later blocks share one struct, the one pyarrow infers from all of them at
    once; no row is lost or changed."""
    metas = [{"k": 1, "deep": [{"u": 1}]}, {"k": 2, "j": 2}, {"k": 3, "deep": [{"v": 1}]}]
    path = write_lines(tmp_path / "in.jsonl", [json.dumps({"prompt": "p", "meta": meta}) for meta in metas])
    reader = RowReader(path, block_rows=1)
    field = reader.passthrough_schema.field("meta")
    assert field.type == pa.array(metas).type
    specs = _parse_all(reader)
    written = [s.passthrough["meta"] for s in specs if isinstance(s, RowSpec)]
    assert pa.array(written, field.type).to_pylist() == pa.array(metas).to_pylist()


def test_later_values_pyarrow_would_change_widen_the_type_or_make_json_text(tmp_path: Path) -> None:
    """pyarrow converts quietly: a string into a list of its characters, 2.9 into 2 inside a list or an object,
    true into 1.0, [] into an object of nulls. Values of later blocks that the first block's type would change
    widen it (an integer column takes floats) or make the column JSON text, as when all are in one block: every row
    reads back as it was written."""
    first = {"prompt": "a", "tags": ["x"], "meta": {"a": 1}, "w": 0.5, "lst": [1], "num": [1]}
    late = [{"tags": "abc"}, {"meta": {"a": 2.9}}, {"w": True}, {"lst": [7.9]}, {"meta": []}, {"lst": [2**63]}]
    late += [{"num": [2.5]}]
    rows = [first] + [{"prompt": "b", **change} for change in late]
    path = write_lines(tmp_path / "in.jsonl", [json.dumps(row) for row in rows])
    for block_rows in (1, 1024):
        reader = RowReader(path, block_rows=block_rows)
        schema = reader.passthrough_schema
        assert [name for name in schema.names if is_json_text(schema.field(name))] == ["tags", "meta", "w", "lst"]
        assert schema.field("num").type == pa.list_(pa.float64())
        specs = _parse_all(reader)
        for row, spec in zip(rows, specs, strict=True):
            assert isinstance(spec, RowSpec)
            for name, value in spec.passthrough.items():
                if value is not None:
                    assert _read_back(value, schema.field(name)) == row[name]


def test_an_integer_a_double_cannot_hold_makes_a_widened_column_json_text(tmp_path: Path) -> None:
    """Blocks of integers and of floats share ``double`` only when every integer is one a double holds exactly
    (2**53 + 1 is not): the earlier blocks are read again to check."""
    for big in (2**53, 2**53 + 1):
        lines = [json.dumps({"prompt": "a", "count": big}), json.dumps({"prompt": "b", "count": 0.5})]
        reader = RowReader(write_lines(tmp_path / "in.jsonl", lines), block_rows=1)
        assert is_json_text(reader.passthrough_schema.field("count")) is (float(big) != big)


def test_booleans_among_numbers_pass_through_as_json_text(tmp_path: Path) -> None:
    lines = ['{"prompt": "a", "score": 1.5}', '{"prompt": "b", "score": true}', '{"prompt": "c", "nums": [1, 2.5]}']
    reader = RowReader(write_lines(tmp_path / "in.jsonl", lines))
    assert is_json_text(reader.passthrough_schema.field("score"))
    assert str(reader.passthrough_schema.field("nums").type) == "list<item: double>"  # 1 widens to 1.0: same number
    specs = _parse_all(reader)
    assert [s.passthrough["score"] for s in specs if isinstance(s, RowSpec)] == ["1.5", "true", None]


def test_only_empty_objects_pass_through_as_json_text(tmp_path: Path) -> None:
    """Objects that are all empty would make a struct of no fields, which Parquet cannot store: JSON text keeps
    every row, nested ones too. An empty object beside one with keys, in any block, takes their struct."""
    lines = [
        '{"prompt": "a", "meta": {}, "deep": {"inner": {}}, "tags": [{}], "ok": {"k": 1}}',
        '{"prompt": "b", "meta": {"added": 1}, "deep": {"inner": {}}, "tags": [], "ok": {"k": 2}}',
    ]
    for block_rows in (1, 1024):
        reader = RowReader(write_lines(tmp_path / "in.jsonl", lines), block_rows=block_rows)
        schema = reader.passthrough_schema
        assert [is_json_text(schema.field(name)) for name in ("meta", "deep", "tags", "ok")] == [
            False,
            True,
            True,
            False,
        ]
        assert schema.field("meta").type == pa.array([{}, {"added": 1}]).type
        specs = _parse_all(reader)
        assert [s.passthrough["deep"] for s in specs if isinstance(s, RowSpec)] == ['{"inner": {}}'] * 2


def test_empty_objects_reach_a_parquet_output(random_models: dict[str, Path], tmp_path: Path) -> None:
    dataset = write_lines(tmp_path / "in.jsonl", ['{"prompt": "a", "meta": {}, "max_new_tokens": 1}'])
    out = tmp_path / "o.parquet"
    code, output = run_cli(run_args(dataset, out, random_models["llama"]))
    assert code == 0, output
    assert pq.read_table(out).column("meta").to_pylist() == ["{}"]


def test_a_lone_surrogate_is_a_bad_row_in_any_column_and_types_no_column(tmp_path: Path) -> None:
    """A lone surrogate, in a value or a field's name, makes its row a bad row; it does not decide the type of the
    good rows' values (found by a helper: the column became JSON text), and a name holding one (which no Arrow
    column can have) was a traceback."""
    lines = [
        '{"prompt": "a", "s": "ok", "j": 1, "deep": {"k": [1]}}',
        '{"prompt": "b", "s": "\\ud800x", "j": "\\ud800", "deep": {"\\udc00": 2}}',
        '{"prompt": "c", "\\ud83d": 1}',
    ]
    good = {"s": "ok", "j": 1, "deep": {"k": [1]}}
    for block_rows in (1, 1024):
        reader = RowReader(write_lines(tmp_path / "in.jsonl", lines), block_rows=block_rows)
        assert reader.passthrough_schema == pa.schema([(name, pa.array([value]).type) for name, value in good.items()])
        specs = _parse_all(reader)
        assert isinstance(specs[0], RowSpec) and specs[0].passthrough == good
        assert isinstance(specs[1], RowError) and specs[1].field == "s" and "lone surrogate" in specs[1].message
        assert isinstance(specs[2], RowError) and (specs[2].field, specs[2].message) == (
            "\\ud83d",
            "its name holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text",
        )


def test_parquet_text_from_an_earlier_output_is_not_encoded_again(tmp_path: Path) -> None:
    field = pa.field("mixed", pa.string(), metadata={b"batchgen_encoding": b"json"})
    table = pa.table({"prompt": ["a", "b"], "mixed": ['"s0"', "1"]}, schema=pa.schema([("prompt", pa.string()), field]))
    pq.write_table(table, tmp_path / "in.parquet")
    reader = RowReader(tmp_path / "in.parquet")
    assert not is_json_text(reader.passthrough_schema.field("mixed"))
    assert [s.passthrough["mixed"] for s in _parse_all(reader) if isinstance(s, RowSpec)] == ['"s0"', "1"]


def test_lines_of_unicode_whitespace_are_blank_to_the_reader_and_the_row_count(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf\n{"prompt": "a"}\n\xc2\xa0\n\x1c\n{"prompt": "b"}\n')
    assert len([row for row in RowReader(path) if isinstance(row, InputRow)]) == 2
    assert count_input_rows(path) == 2


# --- rows.parse_row ---------------------------------------------------------------------------------------

SCHEMA = pa.schema([("topic", pa.string()), ("count", pa.int64()), ("input_text", pa.string())])


def parse(data: dict[str, Any], schema: pa.Schema = SCHEMA, **kwargs: Any) -> RowSpec:
    """``parse_row`` of ``data`` against ``schema``, whose columns are the fields of SCHEMA's rows: ``topic``,
    ``count``, and ``text`` as ``input_text``."""
    names = {n: n for n in schema.names} | {"text": "input_text"}
    return parse_row(InputRow(index=7, line=9, data=data), "in.jsonl", schema, names, **kwargs)


def row_error(data: dict[str, Any], **kwargs: Any) -> RowError:
    with pytest.raises(RowError) as info:
        parse(data, **kwargs)
    assert (info.value.source, info.value.line) == ("in.jsonl", 9)
    return info.value


def test_parse_row_prompt_and_defaults() -> None:
    spec = parse({"prompt": "hi", "temperature": 0, "stop": ["x"], "topic": "t", "text": "renamed"})
    assert spec == RowSpec(
        id="7",
        line=9,
        prompt="hi",
        messages=None,
        prompt_token_ids=None,
        continuation=None,
        chat_template_kwargs=None,
        continue_final_message=False,
        add_generation_prompt=False,
        tools=None,
        sampling_overrides={"temperature": 0, "stop": ["x"]},
        passthrough={"topic": "t", "count": None, "input_text": "renamed"},
    )


_CHAT = [{"role": "user", "content": "Name a planet."}, {"role": "assistant", "content": "The planet is"}]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, (False, True)),
        ({"continue_final_message": None, "add_generation_prompt": None}, (False, True)),
        ({"continue_final_message": True}, (True, False)),  # vLLM asks for add_generation_prompt false as well
        ({"continue_final_message": True, "add_generation_prompt": False}, (True, False)),
        ({"add_generation_prompt": False}, (False, False)),
        ({"continue_final_message": False, "add_generation_prompt": True}, (False, True)),
    ],
)
def test_how_the_chat_template_ends_a_messages_row(fields: dict[str, Any], expected: tuple[bool, bool]) -> None:
    spec = parse({"messages": _CHAT, **fields})
    assert (spec.continue_final_message, spec.add_generation_prompt) == expected


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        (
            {"messages": _CHAT, "continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
            "true with add_generation_prompt true: the last message is continued, or the reply opened after it",
        ),
        ({"messages": _CHAT, "continue_final_message": 1}, "continue_final_message", "must be true or false, got 1"),
        (
            {"messages": _CHAT, "add_generation_prompt": "no"},
            "add_generation_prompt",
            'must be true or false, got "no"',  # shown as JSON, as the row wrote it
        ),
        (
            {"prompt": "The planet is", "continue_final_message": True},
            "continue_final_message",
            "needs messages: a prompt is not rendered by the chat template",
        ),
        (
            {"prompt_token_ids": [1, 2], "add_generation_prompt": False},
            "add_generation_prompt",
            "needs messages: a prompt is not rendered by the chat template",
        ),
    ],
)
def test_a_bad_prompt_end_is_the_rows_error(fields: dict[str, Any], field: str, message: str) -> None:
    error = row_error(fields)
    assert (error.field, error.message) == (field, message)


def test_a_prompt_row_may_give_the_default_prompt_end() -> None:
    """As an OpenAI completions body or a table with the columns for every row gives them."""
    spec = parse({"prompt": "hi", "add_generation_prompt": True, "continue_final_message": False})
    assert (spec.continue_final_message, spec.add_generation_prompt) == (False, False)


def test_an_id_with_no_fraction_is_that_integer() -> None:
    # pandas writes an integer column with nulls as float64 (its missing-data documentation): 4.0 is the id 4.
    assert parse({"prompt": "hi", "id": 4.0}).id == parse({"prompt": "hi", "id": 4}).id == "4"


def test_parse_row_messages_and_token_ids() -> None:
    messages = [{"role": "system", "content": "be brief", "name": None}, {"role": "user", "content": "hi", "name": "u"}]
    spec = parse({"id": "a-1", "messages": messages, "prompt": None})
    assert spec.id == "a-1"
    assert spec.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi", "name": "u"}]
    assert spec.prompt is None and spec.prompt_token_ids is None
    spec = parse({"id": 42, "prompt_token_ids": [1, 2, 3], "seed": None})
    assert (spec.id, spec.prompt_token_ids, spec.sampling_overrides) == ("42", [1, 2, 3], {"seed": None})


def test_parse_row_no_prompt() -> None:
    error = row_error({"topic": "t"})
    assert error.field == "prompt"
    assert error.message == "row has no prompt: give one of prompt, messages, prompt_token_ids (found 'topic')"
    # Found by a new user: a JSONL row's null prompt was reported as no prompt, the null unsaid; the rename hint
    # stays (found by a review).
    error = row_error({"prompt": None, "question": "Hi"})
    assert (error.field, error.message) == (
        "prompt",
        "row has no prompt: give one of prompt, messages, prompt_token_ids ('prompt' is null; found 'question'; "
        "rename it to 'prompt' or pass --prompt-column question)",
    )
    error = row_error({"messages": None, "prompt_token_ids": None})
    assert (error.field, error.message) == (
        "messages",
        "row has no prompt: give one of prompt, messages, prompt_token_ids ('messages' is null; 'prompt_token_ids' "
        "is null; it has no other field)",
    )


def test_a_messages_text_content_parts_are_joined_as_vllm_joins_them() -> None:
    """Found by a new user: OpenAI's content parts were read in an OpenAI Batch file but a bad row in a JSONL one.
    vLLM joins a message's text parts with a newline (its chat utilities' ``_parse_chat_message_content_parts``)."""
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    spec = parse({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": parts}]})
    assert spec.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "one\ntwo"}]
    error = row_error({"messages": [{"role": "user", "content": [*parts, {"type": "image_url", "image_url": {}}]}]})
    assert (error.field, error.message) == ("messages", 'item 0: content part "image_url" is not supported (text only)')
    error = row_error({"messages": [{"role": "user", "content": ["one"]}]})
    assert (error.field, error.message) == ("messages", 'item 0: content part "string" is not supported (text only)')
    error = row_error({"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]})
    assert (error.field, error.message) == ("messages", "item 0: a text part's 'text' must be a string, got 7")


def test_parse_row_two_prompts() -> None:
    error = row_error({"prompt_token_ids": [1], "prompt": "a", "messages": [{"role": "user", "content": "x"}]})
    assert error.field == "messages"
    assert error.message == (
        "give only one of prompt, messages, prompt_token_ids (found: prompt, messages, prompt_token_ids)"
    )


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        ({"prompt": 5}, "prompt", "must be a string, got number"),
        ({"messages": "hi"}, "messages", "must be a non-empty array of {role, content} objects, got string"),
        ({"messages": []}, "messages", "must be a non-empty array of {role, content} objects, got an empty array"),
        ({"messages": [{"role": "user", "content": "a"}, "x"]}, "messages", "item 1 must be an object, got string"),
        ({"messages": [{"role": "user"}]}, "messages", "item 0: 'content' is missing"),
        (
            {"messages": [{"from": "human", "value": "a"}]},
            "messages",
            "item 0: 'role' is missing (ShareGPT's {from, value} items: --messages-column messages reads them)",
        ),
        ({"messages": [{"role": 1, "content": "a"}]}, "messages", "item 0: 'role' must be a string, got number"),
        ({"messages": [{"role": "u", "content": "a", "x": 1}]}, "messages", "item 0: 'x' must be a string, got number"),
        ({"prompt_token_ids": "1 2"}, "prompt_token_ids", "must be a non-empty array of integers, got string"),
        ({"prompt_token_ids": []}, "prompt_token_ids", "must be a non-empty array of integers, got an empty array"),
        ({"prompt_token_ids": [1, True]}, "prompt_token_ids", "item 1 must be an integer, got true"),
        ({"prompt_token_ids": [1, 2.5]}, "prompt_token_ids", "item 1 must be an integer, got 2.5"),
        ({"prompt": "a", "id": True}, "id", "must be a string or an integer, got true"),
        ({"prompt": "a", "id": 1.5}, "id", "must be a string or an integer, got 1.5"),
        ({"prompt": "a", "id": [1]}, "id", "must be a string or an integer, got [1]"),
        ({"prompt": "a", "id": ""}, "id", 'must not be empty or blank (leave "id" out for the row\'s index)'),
        ({"prompt": "a", "id": " \t"}, "id", 'must not be empty or blank (leave "id" out for the row\'s index)'),
        ({"prompt": "a", "id": "x\ud800"}, "id", "holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text"),
        ({"prompt": "\udfff"}, "prompt", "holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text"),
        (
            {"messages": [{"role": "user", "content": "a\ud800"}]},
            "messages",
            "item 0: 'content' holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text",
        ),
    ],
)
def test_parse_row_bad_types(data: dict[str, Any], field: str, message: str) -> None:
    error = row_error(data)
    assert (error.field, error.message) == (field, message)


@pytest.mark.parametrize(
    ("value", "shown"),
    [("3", '"3"'), (1.5, "1.5"), (2**70, str(2**70)), ([1], "[1]")],
)
def test_parse_row_passthrough_type_mismatch(value: Any, shown: str) -> None:
    error = row_error({"prompt": "a", "count": value})
    assert (error.field, error.message) == ("count", f"expected int64 like the other rows, got {shown}")


def test_parse_row_passthrough_accepts_integral_float() -> None:
    assert parse({"prompt": "a", "count": 2.0}).passthrough["count"] == 2.0


def test_parse_row_field_the_schema_lacks() -> None:
    """Only a file changed after its schema was read has a field the schema lacks."""
    error = row_error({"prompt": "a", "surprise": 1})
    assert error.field == "surprise"
    assert error.message == "field not in the dataset when the run read its schema: was the file changed since?"


# --- writer -----------------------------------------------------------------------------------------------

PASSTHROUGH = pa.schema([("topic", pa.string()), ("input_text", pa.string())])
META = {"batchgen.model": "tiny", "batchgen.version": "0.1.0"}


def result_rows(start: int, count: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(start, start + count):
        rows.append(
            {
                "id": str(i),
                "text": f"out{i}",
                "output_token_ids": [i, i + 1],
                "output_logprobs": [-0.5, -0.25] if i % 2 == 0 else None,
                "top_logprobs": [[(i, -0.5), (9, -1.5)], [(i + 1, -0.25)]] if i % 2 == 0 else None,
                "finish_reason": "length",
                "prompt_tokens": 3,
                "completion_tokens": 2,
                "topic": f"t{i}",
            }
        )
    return rows


def expected(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What reading ``rows`` back must give: every column, nulls filled, top logprobs as objects."""
    out = []
    for row in rows:
        full = dict.fromkeys(result_schema(PASSTHROUGH, {}).names) | row
        if full["top_logprobs"] is not None:
            full["top_logprobs"] = [[{"id": t, "logprob": lp} for t, lp in step] for step in full["top_logprobs"]]
        out.append(full)
    return out


def test_result_schema_order_and_metadata() -> None:
    schema = result_schema(PASSTHROUGH, META)
    assert schema.names == [*OUTPUT_COLUMNS.names, "topic", "input_text"]
    assert schema.field("top_logprobs").type == pa.list_(
        pa.list_(pa.struct([("id", pa.int32()), ("logprob", pa.float32())]))
    )
    assert schema.metadata == {b"batchgen.model": b"tiny", b"batchgen.version": b"0.1.0"}
    with pytest.raises(ValueError, match="collide"):
        result_schema(pa.schema([("text", pa.string())]), {})


@pytest.mark.parametrize("suffix", [".arrow", ".ipc", ".feather", ".parquet", ".jsonl"])
def test_writer_round_trip(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"out{suffix}"
    with open_result_writer(path, PASSTHROUGH, META) as writer:
        writer.write(result_rows(0, 2))
        writer.write([])
        writer.write(result_rows(2, 3))
    writer.close()  # idempotent
    table = read_results(path)
    assert table.to_pylist() == expected(result_rows(0, 5))
    if suffix == ".jsonl":
        assert json.loads(path.read_text().splitlines()[0])["top_logprobs"][0] == [
            {"id": 0, "logprob": -0.5},
            {"id": 9, "logprob": -1.5},
        ]
    else:
        assert table.schema == result_schema(PASSTHROUGH, META).remove_metadata()
        assert table.schema.metadata is not None
        assert {k: table.schema.metadata[k] for k in (b"batchgen.model", b"batchgen.version")} == {
            b"batchgen.model": b"tiny",
            b"batchgen.version": b"0.1.0",
        }


def test_jsonl_output_is_strict_json_with_nan_and_infinity_as_null(tmp_path: Path) -> None:
    passthrough = pa.schema([("w", pa.float64()), ("nums", pa.list_(pa.float64()))])
    rows = [{"id": "a", "sample_index": 0, "w": math.inf, "nums": [1.5, math.nan, -math.inf]}, {"id": "b", "w": 2.5}]
    for suffix in (".jsonl", ".arrow"):
        path = tmp_path / f"out{suffix}"
        with open_result_writer(path, passthrough, META) as writer:
            writer.write(rows)
        if suffix == ".jsonl":

            def strict(name: str) -> None:
                raise AssertionError(f"not JSON: {name}")

            lines = [json.loads(line, parse_constant=strict) for line in path.read_text().splitlines()]
            assert [(r["w"], r["nums"]) for r in lines] == [(None, [1.5, None, None]), (2.5, None)]
        else:  # Arrow keeps them
            assert read_results(path).column("w").to_pylist()[0] == math.inf


def test_parquet_one_row_group_per_write(tmp_path: Path) -> None:
    path = tmp_path / "out.parquet"
    with open_result_writer(path, PASSTHROUGH, META) as writer:
        for start, count in [(0, 2), (2, 1), (3, 4)]:
            writer.write(result_rows(start, count))
    metadata = pq.ParquetFile(path).metadata
    assert [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)] == [2, 1, 4]


@pytest.mark.parametrize("suffix", [".arrow", ".parquet", ".jsonl"])
def test_writer_zero_rows_is_valid_file(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"out{suffix}"
    open_result_writer(path, PASSTHROUGH, META).close()
    table = read_results(path)
    assert table.num_rows == 0
    want = OUTPUT_COLUMNS if suffix == ".jsonl" else result_schema(PASSTHROUGH, {})
    assert table.schema.remove_metadata() == want


def test_a_jsonl_outputs_column_of_mixed_values_reads_as_json_text(tmp_path: Path) -> None:
    """A .jsonl output writes a JSON-text column's values as the input had them (a number, a string); read_results
    reads such a column back as JSON text, as batchgen types it in an input (it raised; helper 63)."""
    path = tmp_path / "out.jsonl"
    text = pa.string()
    schema = pa.schema(
        [pa.field("k", text, metadata=JSON_TEXT_METADATA), pa.field("big", text, metadata=JSON_TEXT_METADATA)]
    )
    rows = result_rows(0, 3)
    for row, value, big in zip(rows, ["1", '"x"', '[["b", 2]]'], ["1180591620717411303424", "5", None]):
        del row["topic"]
        row["k"], row["big"] = value, big  # big: integers beyond 64 bits, which the input typed as JSON text
    with open_result_writer(path, schema, META) as writer:
        writer.write(rows)
    assert [json.loads(line)["k"] for line in path.read_text().splitlines()] == [1, "x", [["b", 2]]]
    table = read_results(path)
    assert is_json_text(table.schema.field("k"))
    assert table.column("k").to_pylist() == ["1", '"x"', '[["b", 2]]']
    assert table.column("big").to_pylist() == ["1180591620717411303424", "5", None]
    assert table.column("text").to_pylist() == ["out0", "out1", "out2"]


def test_jsonl_readable_after_each_write(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    writer = open_result_writer(path, PASSTHROUGH, META)
    writer.write(result_rows(0, 2))
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["0", "1"]
    writer.write(result_rows(2, 1))
    assert read_results(path).column("text").to_pylist() == ["out0", "out1", "out2"]
    writer.close()


@pytest.mark.parametrize("suffix", [".arrow", ".parquet"])
def test_binary_writers_flush_each_write_to_the_os(tmp_path: Path, suffix: str) -> None:
    # These formats are readable only once close() writes the footer; each write must still reach the file.
    path = tmp_path / f"out{suffix}"
    writer = open_result_writer(path, PASSTHROUGH, META)
    sizes = [path.stat().st_size]
    for start in (0, 2):
        writer.write(result_rows(start, 2))
        sizes.append(path.stat().st_size)
    writer.close()
    assert sizes[0] < sizes[1] < sizes[2] < path.stat().st_size
    assert read_results(path).column("id").to_pylist() == ["0", "1", "2", "3"]


def test_writer_rejects_bad_rows_and_writes_after_close(tmp_path: Path) -> None:
    writer = open_result_writer(tmp_path / "out.jsonl", PASSTHROUGH, META)
    with pytest.raises(ValueError, match=r"not output columns: \['bogus'\]"):
        writer.write([{"id": "0", "bogus": 1}])
    with pytest.raises(pa.ArrowInvalid):
        writer.write([{"id": "0", "prompt_tokens": "many"}])
    writer.close()
    with pytest.raises(ValueError, match="writer is closed"):
        writer.write(result_rows(0, 1))


def test_open_result_writer_errors(tmp_path: Path) -> None:
    with pytest.raises(BatchgenError) as info:
        open_result_writer(tmp_path / "out.csv", PASSTHROUGH, META)
    assert str(info.value) == (
        f"{tmp_path / 'out.csv'}: unsupported output format '.csv' (use .arrow, .ipc, .feather, .parquet or .jsonl)"
    )
    missing = tmp_path / "no" / "such"
    with pytest.raises(BatchgenError) as info:
        open_result_writer(missing / "out.arrow", PASSTHROUGH, META)
    assert str(info.value) == f"{missing / 'out.arrow'}: output directory '{missing}' does not exist"


def test_read_results_unclosed_arrow_file_is_batchgen_error(tmp_path: Path) -> None:
    path = tmp_path / "out.arrow"
    writer = open_result_writer(path, PASSTHROUGH, META)
    writer.write(result_rows(0, 1))
    with pytest.raises(BatchgenError, match="cannot read results"):
        read_results(path)
    writer.close()


def test_parquet_input_to_jsonl_output_end_to_end(tmp_path: Path) -> None:
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "text": ["x", None], "blob": [b"\x00\x01", None]}), source)
    reader = RowReader(source)
    specs = [
        parse_row(r, reader.source, reader.passthrough_schema, reader.passthrough_names)
        for r in reader
        if isinstance(r, InputRow)
    ]
    out = tmp_path / "out.jsonl"
    with open_result_writer(out, reader.passthrough_schema, {}) as writer:
        writer.write([{"id": s.id, "text": s.prompt.upper() if s.prompt else None, **s.passthrough} for s in specs])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(d["id"], d["text"], d["input_text"], d["blob"]) for d in lines] == [
        ("0", "A", "x", "AAE="),
        ("1", "B", None, None),
    ]


def test_passthrough_that_fits_keeps_what_fits() -> None:
    schema = pa.schema([("keep", pa.string()), ("meta", pa.struct([("a", pa.int64())]))])
    data = {"prompt": "x", "temperature": "bad", "keep": "B", "meta": {"a": 1, "new": 2}}
    assert passthrough_that_fits(data, schema, {"keep": "keep", "meta": "meta"}) == {"keep": "B", "meta": None}


def test_json_text_fields_get_one_warning_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from batchgen.io.field_warnings import warn_about_json_text_fields

    path = write_lines(tmp_path / "in.jsonl", ['{"prompt": "a", "x": 1, "y": 2}', '{"prompt": "b", "x": "s", "y": 3}'])
    reader = RowReader(path)
    warn_about_json_text_fields(path, reader.passthrough_schema)
    assert capsys.readouterr().err.splitlines() == [
        f"batchgen: warning: {path}: field 'x': no one type stores all its values unchanged, its objects are all "
        "empty, or they nest over 64 deep; it passes through as JSON text (a string column)"
    ]


@pytest.mark.parametrize(("depth", "json_text"), [(63, False), (64, True)])
def test_a_field_nested_deeper_than_arrow_writes_is_json_text(depth: int, json_text: bool, tmp_path: Path) -> None:
    """Arrow's IPC writer refuses a type nested past 64 levels ("Max recursion depth reached"; found by a helper: the
    first flush failed, and the run lost every row). 63 objects around a number nest 64 deep, 64 objects 65."""
    value: Any = 1
    for _ in range(depth):
        value = {"x": value}
    reader = RowReader(write_lines(tmp_path / "in.jsonl", [json.dumps({"prompt": "a", "nest": value})]))
    field = reader.passthrough_schema.field("nest")
    assert is_json_text(field) == json_text
    (row,) = [r for r in reader if isinstance(r, InputRow)]
    spec = parse_row(row, reader.source, reader.passthrough_schema, reader.passthrough_names)
    out = tmp_path / "out.arrow"
    with open_result_writer(out, reader.passthrough_schema, {}) as writer:  # the write that failed
        writer.write([{"id": spec.id, **spec.passthrough}])
    stored = pa.ipc.open_file(out).read_all().column("nest")[0].as_py()
    assert (json.loads(stored) if json_text else stored) == value


@pytest.mark.parametrize("arrow_type", [pa.int64(), pa.float64(), pa.string(), pa.bool_()], ids=str)
def test_flat_columns_accept_exactly_what_pyarrow_stores_unchanged(arrow_type: pa.DataType) -> None:
    """The per-row shortcut for flat columns agrees with storing each value in pyarrow and reading it back."""
    values = [0, -1, 2**53, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 10**400, 2.0, 2.5, 1e300, 9.3e18]
    values += [-0.0, float("nan"), float("inf"), True, False, "x", "\ud800", "", [1], {"a": 1}]
    for value in values:
        try:
            stored = pa.array([value], type=arrow_type).to_pylist()[0]
            kept = type(stored) is type(value) or {type(stored), type(value)} == {int, float}
            kept = kept and (stored == value or stored != stored and value != value)
        except (pa.ArrowException, TypeError, ValueError, OverflowError, UnicodeError):
            kept = False
        assert (misfit(value, arrow_type) is None) == kept, value
