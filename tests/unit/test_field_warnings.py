"""Which pass-through field names are warned about as sampling fields batchgen does not read."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io.field_warnings import foreign_field_warning, warn_about_fields, warn_about_passthrough_names
from batchgen.io.input_options import InputOptions
from batchgen.io.reader import RowReader


@pytest.mark.parametrize(
    ("name", "meant"),
    [("temprature", "temperature"), ("topk", "top_k"), ("Temperature", "temperature"), ("logprob", "logprobs")],
)
def test_a_misspelt_sampling_field_is_named(name: str, meant: str) -> None:
    assert foreign_field_warning(name) == (
        f"field '{name}' is not a sampling field (did you mean '{meant}'?); it is passed through unused"
    )


# vLLM's SamplingParams fields (its documented list) that batchgen has no option for; a new user's rows held them.
@pytest.mark.parametrize("name", ["detokenize", "spaces_between_special_tokens", "typical_p"])
def test_other_engines_sampling_fields_are_named_unsupported(name: str) -> None:
    assert foreign_field_warning(name) == (
        f"field '{name}' is not supported: batchgen has no such option; it is passed through unused"
    )


# Data that a helper's dataset held: a plural or a unit suffix of a sampling field's name is no misspelling.
@pytest.mark.parametrize("name", ["temperature_c", "seeds", "top_ks", "temperatures", "stops", "category", "answer"])
def test_data_columns_are_not_warned_about(name: str) -> None:
    assert foreign_field_warning(name) is None


def test_columns_the_options_read_are_not_warned_about(capsys: pytest.CaptureFixture[str]) -> None:
    template = InputOptions(prompt_template="Summarize {city} in {max_length} words.")
    warn_about_passthrough_names(Path("in.jsonl"), ["city", "max_length", "do_sample"], template)
    assert capsys.readouterr().err == (
        "batchgen: warning: in.jsonl: field 'do_sample' is not read (batchgen samples unless 'temperature' is 0: give "
        "temperature 0 for HF's do_sample false); it is passed through unused\n"
    )


def test_a_jsonl_field_is_named_with_its_first_line_and_its_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Lines 3 and 5 have the misspelt field (line 2 is blank, counted as JSONL lines are); line 6 has another.
    lines = ['{"prompt": "a"}', "", '{"prompt": "b", "temprature": 0.5}', '{"prompt": "c"}']
    lines += ['{"prompt": "d", "temprature": 0.1}', '{"prompt": "e", "num_beams": 4}']
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    warn_about_fields(RowReader(path), None, None, True)
    assert capsys.readouterr().err.splitlines() == [
        f"batchgen: warning: {path}:3 and 1 more row: field 'temprature' is not a sampling field (did you mean "
        "'temperature'?); it is passed through unused",
        f"batchgen: warning: {path}:6: field 'num_beams' is not supported: batchgen has no such option; it is "
        "passed through unused",
    ]
    # A shard of a folder is named by its own path; a Parquet column, which every row has, by the dataset.
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "0.jsonl").write_text("\n".join(lines[:3]) + "\n")
    (tmp_path / "shards" / "1.jsonl").write_text("\n".join(lines[3:]) + "\n")
    warn_about_fields(RowReader(tmp_path / "shards"), None, None, True)
    first, second = capsys.readouterr().err.splitlines()
    assert first.startswith(f"batchgen: warning: {tmp_path / 'shards' / '0.jsonl'}:3 and 1 more row: ")
    assert second.startswith(f"batchgen: warning: {tmp_path / 'shards' / '1.jsonl'}:3: field 'num_beams'")
    pq.write_table(pa.table({"prompt": ["a", "b"], "temprature": [0.5, None]}), tmp_path / "in.parquet")
    warn_about_fields(RowReader(tmp_path / "in.parquet"), None, None, True)
    assert capsys.readouterr().err.startswith(f"batchgen: warning: {tmp_path / 'in.parquet'}: field 'temprature'")
