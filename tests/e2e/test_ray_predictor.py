"""``batchgen.ray.Predictor`` called as ``map_batches`` calls it, on each batch format, without a cluster (it imports
no Ray itself): the input rows come back with batchgen's output columns, as ``batchgen run`` writes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from batchgen.errors import RowError
from batchgen.io.writer import OUTPUT_COLUMNS
from batchgen.ray import Predictor
from tests.helpers.cli import generate, write_jsonl

ENGINE = {"dtype": "float32", "device": "cpu", "seed": 3}
# Every row has every field: a table's columns (None where a row leaves the default).
ROWS = [
    {"id": 10, "prompt": "a b c", "max_tokens": 4, "topic": "x", "n": None, "temperature": None},
    {"id": 11, "prompt": "d e", "max_tokens": 6, "topic": "y", "n": 2, "temperature": 1.0},
    {"id": 12, "prompt": "f", "max_tokens": 3, "topic": "z", "n": None, "temperature": None},
]


@pytest.fixture(scope="module")
def model(random_models: dict[str, Path]) -> Path:
    return random_models["llama"]


@pytest.fixture(scope="module")
def predictor(model: Path) -> Predictor:
    return Predictor(str(model), temperature=0.0, **ENGINE)


@pytest.fixture(scope="module")
def file_rows(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """What ``batchgen run`` writes for ROWS with the same options: the reference."""
    tmp = tmp_path_factory.mktemp("predictor")
    dataset = write_jsonl(tmp / "in.jsonl", [{k: v for k, v in row.items() if v is not None} for row in ROWS])
    return generate(dataset, tmp / "out.arrow", model, "--temperature", "0", "--seed", "3")


def _by_sample(table: pa.Table) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["id"], r["sample_index"]): r for r in table.to_pylist()}


@pytest.mark.parametrize("batch_format", ["pyarrow", "pandas", "numpy"])
def test_rows_come_back_with_the_output_columns_of_batchgen_run(
    batch_format: str, predictor: Predictor, file_rows: dict[str, dict[str, Any]]
) -> None:
    table = pa.Table.from_pylist(ROWS)
    batch: Any = {
        "pyarrow": table,
        "pandas": table.to_pandas(),
        "numpy": {
            name: np.asarray(column.to_pylist(), dtype=object)
            for name, column in zip(table.column_names, table.columns)
        },
    }[batch_format]
    out = predictor(batch)
    # The input's columns (its id replaced by batchgen's string id), then every output column, typed as in a file.
    assert out.column_names == [*(n for n in table.column_names if n != "id"), *OUTPUT_COLUMNS.names]
    assert out.schema.field("output_token_ids").type == OUTPUT_COLUMNS.field("output_token_ids").type
    samples = _by_sample(out)
    assert sorted(samples) == [("10", 0), ("11", 0), ("11", 1), ("12", 0)]  # n = 2 gives two rows
    for (rid, _), row in samples.items():
        assert row["topic"] == next(r["topic"] for r in ROWS if str(r["id"]) == rid)
        if rid != "11":  # greedy rows: as the file run's; the sampled row's draws depend on the run seed
            reference = file_rows[rid]
            for column in ("output_token_ids", "text", "finish_reason", "prompt_tokens"):
                assert row[column] == reference[column], (rid, column)


def test_column_options_a_clashing_column_and_bad_rows(model: Path) -> None:
    predictor = Predictor(str(model), prompt_template="Q: {question}", max_new_tokens=3, temperature=0.0, **ENGINE)
    table = pa.table({"question": ["one", None, "three"], "text": ["t1", "t2", "t3"]})
    out = predictor(table)
    rows = out.to_pylist()
    assert [r["input_text"] for r in rows] == ["t1", "t2", "t3"]  # kept under another name, as a file run does
    assert [r["id"] for r in rows] == ["0", "1", "2"]
    assert rows[0]["completion_tokens"] == 3 and rows[0]["error"] is None
    assert rows[1]["finish_reason"] == "error" and rows[1]["error"].startswith("rows:2: ")
    failing = Predictor(str(model), on_error="fail", prompt_template="Q: {question}", **ENGINE)
    with pytest.raises(RowError, match="^rows:2: "):
        failing(table)


def test_an_empty_batch_and_an_unknown_option(predictor: Predictor) -> None:
    out = predictor(pa.Table.from_pylist(ROWS).slice(0, 0))
    assert out.num_rows == 0 and "text" in out.column_names
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_tokens' \\(did you mean 'max_new_tokens'"):
        Predictor("x", max_tokens=3)
