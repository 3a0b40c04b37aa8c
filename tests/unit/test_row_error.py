"""A ``RowError`` crosses a process boundary intact (a Ray replica's reaches the driver pickled)."""

from __future__ import annotations

import pickle

from batchgen.errors import RowError


def test_a_row_error_pickles_with_its_parts() -> None:
    error = pickle.loads(pickle.dumps(RowError("in.jsonl", 61, "prompt_token_ids", "id 99999 is outside")))
    assert isinstance(error, RowError)
    assert (error.source, error.line, error.field, error.message) == (
        "in.jsonl",
        61,
        "prompt_token_ids",
        "id 99999 is outside",
    )
    assert str(error) == "in.jsonl:61: field 'prompt_token_ids': id 99999 is outside"
