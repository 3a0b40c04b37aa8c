"""Which pass-through field names are warned about as sampling fields batchgen does not read."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchgen.io.field_warnings import foreign_field_warning, warn_about_passthrough_names
from batchgen.io.input_options import InputOptions


@pytest.mark.parametrize(
    ("name", "meant"),
    [("temprature", "temperature"), ("topk", "top_k"), ("Temperature", "temperature"), ("logprob", "logprobs")],
)
def test_a_misspelt_sampling_field_is_named(name: str, meant: str) -> None:
    assert foreign_field_warning(name) == (
        f"field '{name}' is not a sampling field (did you mean '{meant}'?); it is passed through unused"
    )


# vLLM's SamplingParams fields (its documented list) that batchgen has no option for; a new user's rows held them.
@pytest.mark.parametrize("name", ["detokenize", "spaces_between_special_tokens", "truncate_prompt_tokens"])
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
