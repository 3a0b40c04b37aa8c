"""A constraint's text names a special token (``<s>``, ``</s>``): the row's text still satisfies it. xgrammar matches a
special token by its text, so a ``choice`` of ``"</s>"`` took the EOS id as the whole string (the row ended with an
empty text), and ``<s>`` as a token, which the text drops (``skip_special_tokens``, the default). The reference is
the constraint itself: each text is one of the choices, or matches the regex (``re.fullmatch``).

Both special ids are biased up so that each is sampled wherever it is allowed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.cli import generate, write_jsonl

pytest.importorskip("xgrammar", reason='grammars need xgrammar (pip install -e ".[structured]")')

BOS, EOS = 0, 1  # tests.helpers.models.build_tokenizer's <s> and </s>
CHOICES = ["</s>", "<s>ab"]
REGEX = r"<s>[a-c]{1,3}</s>"
SAMPLED = {"temperature": 1.0, "max_new_tokens": 24, "logit_bias": {str(BOS): 8.0, str(EOS): 8.0}}


@pytest.mark.parametrize("skip_special", [True, False])
def test_special_token_text_in_a_constraint_stays_in_the_text(
    skip_special: bool, random_models: dict[str, Path], tmp_path: Path
) -> None:
    rows = [{"id": f"c{s}", "prompt": "Say:", "choice": CHOICES, "seed": s} for s in range(8)]
    rows += [{"id": f"r{s}", "prompt": "Say:", "regex": REGEX, "seed": s} for s in range(8)]
    rows = [{**row, **SAMPLED, "skip_special_tokens": skip_special} for row in rows]
    out = generate(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", random_models["llama"])
    for row in out.values():
        assert row["finish_reason"] == "stop" and row["output_token_ids"][-1] == EOS, row
        if row["id"][0] == "c":
            assert row["text"] in CHOICES, row
        else:
            assert re.fullmatch(REGEX, row["text"]), row
    # A row whose text keeps special tokens may take one for its text, as the biases ask.
    took_special = any(BOS in row["output_token_ids"] or row["output_token_ids"].count(EOS) > 1 for row in out.values())
    assert took_special == (not skip_special)
