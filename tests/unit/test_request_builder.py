"""Row errors of ``RequestBuilder`` name the field the row gave."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from batchgen.errors import RowError
from batchgen.io.input_row import InputRow
from batchgen.io.rows import parse_row
from batchgen.job.request_builder import RequestBuilder
from batchgen.sampling.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"prompt": "hi"}, "prompt"),
        # Found by a new user: a messages row on a model with no tokenizer was told about 'prompt'.
        ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ({"prompt_token_ids": [3, 4], "stop": "x"}, "stop"),
        ({"prompt_token_ids": [3, 4], "bad_words": ["x"]}, "bad_words"),
    ],
)
def test_a_model_without_a_tokenizer_names_the_field_that_needs_one(data: dict[str, Any], field: str) -> None:
    builder = RequestBuilder(None, 512, 256, [], SamplingParams(), run_seed=0)
    spec = parse_row(InputRow(index=0, line=3, data=data), "in.jsonl", pa.schema([]), {})
    with pytest.raises(RowError) as caught:
        builder.build(spec, "in.jsonl")
    assert str(caught.value) == (
        f"in.jsonl:3: field '{field}': this model has no tokenizer: give prompt_token_ids and no stop strings or "
        "bad words"
    )


def test_a_grammar_on_a_model_without_a_tokenizer_is_a_row_error() -> None:
    """Found by a helper: a regex row on a tokenizer-less model raised xgrammar's ValueError, even under skip."""
    builder = RequestBuilder(None, 512, 256, [], SamplingParams(), run_seed=0)
    spec = parse_row(
        InputRow(index=0, line=2, data={"prompt_token_ids": [3, 4], "regex": "[a-z]+"}), "in", pa.schema([]), {}
    )
    with pytest.raises(RowError) as caught:
        builder.build(spec, "in.jsonl")
    assert str(caught.value) == "in.jsonl:2: field 'regex': this model has no tokenizer, which a grammar needs"
