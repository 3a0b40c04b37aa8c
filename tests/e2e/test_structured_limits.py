"""Constraints at the edges of what a model can write.

A constraint's text names a special token (``<s>``, ``</s>``): the row's text still satisfies it. xgrammar matches a
special token by its text, so a ``choice`` of ``"</s>"`` took the EOS id as the whole string (the row ended with an
empty text), and ``<s>`` as a token, which the text drops (``skip_special_tokens``, the default). The reference is
the constraint itself: each text is one of the choices, or matches the regex (``re.fullmatch``); both special ids
are biased up so that each is sampled wherever it is allowed.

A constraint no token can start is a row error; a row whose grammar allows no next token ends there.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.helpers.cli import generate, write_jsonl

xgrammar = pytest.importorskip("xgrammar", reason='grammars need xgrammar (pip install -e ".[structured]")')

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


def test_a_constraint_no_token_can_start_is_a_row_error(random_models: dict[str, Path], tmp_path: Path) -> None:
    """Found by helper 108: every token masked, such a row wrote id 0 to its length. Python's re.fullmatch takes no
    string for [^\\s\\S], nor xgrammar's EBNF any for a rule that only refers to itself."""
    rows = [{"id": "r", "prompt": "x", "regex": "[^\\s\\S]"}, {"id": "e", "prompt": "x", "ebnf": "root ::= root"}]
    rows += [{"id": "ok", "prompt": "x", "regex": "[ab]"}]
    out = generate(
        write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", random_models["llama"], "--on-error", "skip"
    )
    assert out["ok"]["finish_reason"] == "stop" and out["ok"]["text"] in ("a", "b")
    for rid, field in (("r", "regex"), ("e", "ebnf")):
        assert out[rid]["finish_reason"] == "error", out[rid]
        assert f"field '{field}': no token can start it: it matches nothing this model can write" in out[rid]["error"]


def test_a_row_whose_grammar_allows_no_next_token_ends_there(random_models: dict[str, Path], tmp_path: Path) -> None:
    """A JSON string of control characters alone: xgrammar opens the string, then allows no character (JSON escapes
    them, xgrammar leaves them out of a pattern's class), so the row ends, incomplete ("length"), every token one its
    grammar takes (found by helper 108: id 0 to max_new_tokens)."""
    schema = {"type": "string", "pattern": "^[\\x00-\\x1f]+$"}
    rows = [{"id": "j", "prompt": "x", "json_schema": schema, "max_new_tokens": 20}]
    model = random_models["llama"]
    out = generate(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", model, "--logprobs")
    row = out["j"]
    assert row["finish_reason"] == "length" and 0 < len(row["output_token_ids"]) < 20, row
    assert len(row["output_logprobs"]) == len(row["output_token_ids"])
    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model))
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(schema)))
    assert all(matcher.accept_token(t) for t in row["output_token_ids"])
