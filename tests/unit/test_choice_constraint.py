"""A row's ``choice`` (vLLM's ``guided_choice``): the output is exactly one of the strings. The reference is the
list itself: xgrammar's own matcher over the compiled grammar accepts each string whole and nothing else (no
prefix, no extension, no string with its escapes written out)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchgen.errors import FieldError
from batchgen.sampling.constraints import constraint_grammar, normalize_constraint
from batchgen.sampling.row_fields import make_sampling_params
from batchgen.sampling.sampling_params import SamplingParams
from tests.helpers.models import build_tokenizer

xgrammar = pytest.importorskip("xgrammar", reason='grammars need xgrammar (pip install -e ".[structured]")')
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

# Strings whose characters an EBNF literal must escape or carry: quotes, backslashes, control characters, an EBNF
# operator, non-ASCII text; and one that is a prefix of another.
CHOICES = ["yes", "yes please", 'say "no"', "back\\slash", "two\nlines\ttab", "a | b", "(x)*", "ctl\x01", "été 🎉", ""]
# Control characters before hex digits: xgrammar prints U+0001 as \x01 when it compiles, and read "\x011" as U+0011.
HEX_AFTER = ["\x011", "a\x1fb", "x\x01f", "a\x02bcd", "\x7fff", "\t1"]


def test_the_grammar_takes_exactly_the_choices() -> None:
    grammar = constraint_grammar("choice", normalize_constraint("choice", CHOICES))
    for text in CHOICES:
        assert _is_grammar_accept_string(grammar, text), text
    others = ["ye", "yes pleas", "yesyes", 'say \\"no\\"', "back\\\\slash", "two\\nlines\\ttab", "a", "(x)", "ete 🎉"]
    for text in others:
        assert not _is_grammar_accept_string(grammar, text), text


def test_control_characters_before_hex_digits_survive_compiling(tmp_path: Path) -> None:
    """Found by a helper: a choice of "\x011" gave the text "\x11". Compiled for a tokenizer (which prints the
    grammar and reads it again), each string is accepted whole and its misreading is not."""
    info = xgrammar.TokenizerInfo.from_huggingface(build_tokenizer(tmp_path), vocab_size=400)
    compiled = xgrammar.GrammarCompiler(info).compile_grammar(
        constraint_grammar("choice", normalize_constraint("choice", HEX_AFTER))
    )
    for text in HEX_AFTER:
        assert xgrammar.GrammarMatcher(compiled).accept_string(text), text
    for text in ["\x11", "a\u01fb", "x\x1f", "a\u2bcd", "\u7fff"]:
        assert not xgrammar.GrammarMatcher(compiled).accept_string(text), text


def test_an_ebnf_rows_escapes_before_hex_digits_survive_compiling(tmp_path: Path) -> None:
    """The same fault in a row's own EBNF (a review): "\\u00011" is U+0001 then "1", as JSON and xgrammar's EBNF read
    it, and batchgen's matcher for the row takes exactly that."""
    from batchgen.sampling.grammar import GrammarCompiler

    compiler = GrammarCompiler(build_tokenizer(tmp_path), 400)
    assert compiler.matcher("ebnf", 'root ::= "\\u00011"', eos_ids=[1]).matcher.accept_string("\x011")
    assert not compiler.matcher("ebnf", 'root ::= "\\u00011"', eos_ids=[1]).matcher.accept_string("\x11")


# Characters xgrammar prints as \xHH (U+0080-U+00FF) before hex digits, in each kind of constraint (helper 108:
# "100°C" came out as "100\u0b0c" from a choice, an enum and a property name); each with the string batchgen's
# matcher must take whole, and its misreading.
LATIN_1 = [
    ("choice", json.dumps(["100°C", "niñas", "é1"]), "100°C", "100\u0b0c"),
    ("choice", json.dumps(["100°C", "niñas", "é1"]), "niñas", "ni\u0f1as"),
    ("json_schema", json.dumps({"enum": ["°C", "°F"]}), '"°C"', '"\u0b0c"'),
    (
        "json_schema",
        json.dumps({"properties": {"t°C": {"type": "integer"}}, "required": ["t°C"]}),
        '{"t°C": 1}',
        '{"t\u0b0c',
    ),
    ("regex", "é1|°C", "°C", "\u0b0c"),
    ("ebnf", 'root ::= "°C"', "°C", "\u0b0c"),
]


@pytest.mark.parametrize(("kind", "text", "whole", "misread"), LATIN_1, ids=[c[0] + ":" + c[2] for c in LATIN_1])
def test_latin_1_before_hex_digits_survives_compiling(
    kind: str, text: str, whole: str, misread: str, tmp_path: Path
) -> None:
    from batchgen.sampling.grammar import GrammarCompiler

    compiler = GrammarCompiler(build_tokenizer(tmp_path), 400)
    assert _is_grammar_accept_string(constraint_grammar(kind, text), whole)  # the constraint's own sentence
    matched = compiler.matcher(kind, text, eos_ids=[1]).matcher
    assert matched.accept_string(whole) and matched.accept_token(1), (kind, whole)
    assert not compiler.matcher(kind, text, eos_ids=[1]).matcher.accept_string(misread), (kind, misread)


@pytest.mark.parametrize(
    "given",
    [["a", "b"], ("a", "b"), '["a", "b"]', ' [ "a" , "b" ] '],
    ids=["list", "tuple", "JSON text", "JSON text spaced"],
)
def test_a_choice_is_kept_as_the_json_text_of_its_list(given: Any) -> None:
    """A row gives a list, a flag or a config file its JSON text, Python a tuple too: one choice is one text (a resume
    compares the run's)."""
    assert normalize_constraint("choice", given) == '["a", "b"]'
    assert normalize_constraint("choice", ["é"]) == '["é"]'  # its characters as they are, not \u00e9


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ([], "must be a non-empty array of strings, got []"),
        (["a", 1], 'must be a non-empty array of strings, got ["a", 1]'),
        ({"a": 1}, "must be a non-empty array of strings"),
        ("yes", 'must be an array of strings, got "yes"'),
        (["a\x00b"], "holds NUL (U+0000)"),
        ('"yes"', 'must be a non-empty array of strings, got "yes"'),
        (["\ud800"], "lone surrogate"),
        (5, "must be a non-empty array of strings, got 5"),
    ],
)
def test_a_bad_choice_is_refused_naming_the_field(given: Any, says: str) -> None:
    with pytest.raises(FieldError) as raised:
        normalize_constraint("choice", given)
    assert raised.value.field == "choice" and says in raised.value.message


def test_a_rows_choice_replaces_the_runs_other_constraint_and_is_one_of_four() -> None:
    run = SamplingParams(regex="[0-9]+")
    params = make_sampling_params(run, {"choice": ["x", "y"]}, vocab_size=512)
    assert (params.choice, params.regex, params.constraint) == ('["x", "y"]', None, ("choice", '["x", "y"]'))
    with pytest.raises(FieldError) as raised:
        make_sampling_params(SamplingParams(), {"regex": "a", "choice": ["a"]}, vocab_size=512)
    assert raised.value.field == "choice"
    assert "give only one of json_schema, regex, ebnf, choice (found: regex, choice)" in raised.value.message
