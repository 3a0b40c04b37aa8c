"""Regex anchors xgrammar ignores are refused; the outside reference is Python's ``re``: each refused pattern
fully matches nothing that xgrammar's grammar accepts for it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from batchgen.errors import FieldError
from batchgen.sampling.constraints import constraint_grammar, normalize_constraint
from batchgen.sampling.grammar import GrammarCompiler
from batchgen.sampling.regex_support import check_regex
from tests.helpers.models import build_tokenizer

xgrammar = pytest.importorskip("xgrammar", reason='grammars need xgrammar (pip install -e ".[structured]")')
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

# (pattern, a string xgrammar accepts for it that re.fullmatch rejects, the start of the refusal): anchors inside
# the pattern, which xgrammar ignores; \A and \Z, letters to it, and [\^...], a negated class to it (helper 64).
REFUSED = [
    ("a$b", "ab", "'$' at position 1 "),
    ("x(^a)", "xa", "'^' at position 2 "),
    ("a^b", "ab", "'^' at position 1 "),
    (r"a\|^b", "a|b", "'^' at position 3 "),
    (r"\Aab\Z", "AabZ", "'\\A' at position 0 is not supported"),
    (r"[\^]x", ",x", "'[\\^' at position 0"),
    # Helper 83: xgrammar reads [^] as any character, then the rest of what Python reads as one class.
    (r"[^]a]x", "qa]x", "'[^]' at position 0"),
    # Helper 108: the caret written in hex or octal, which Python reads as a character too.
    (r"[\x5e]", "a", "'[\\x5e' at position 0 is read by xgrammar as a negated class"),
]


@pytest.mark.parametrize(("pattern", "text", "message"), REFUSED)
def test_what_xgrammar_would_not_enforce_is_refused(pattern: str, text: str, message: str) -> None:
    assert re.fullmatch(pattern, text) is None
    assert _is_grammar_accept_string(xgrammar.Grammar.from_regex(pattern), text)
    with pytest.raises(FieldError, match=re.escape(f"field 'regex': {message}")):
        normalize_constraint("regex", pattern)


@pytest.mark.parametrize("pattern", [r"[\U0000005e]a", r"[\136]", r"[\x5E-a]"])
def test_a_caret_escaped_any_way_first_in_a_class_is_refused(pattern: str) -> None:
    r"""Python reads each as a class holding ^ (re.fullmatch takes "^" or "^a"); batchgen writes the escape as \^,
    which xgrammar reads as a negation (helper 111: \U0000005e passed)."""
    assert re.fullmatch(pattern, "^a") or re.fullmatch(pattern, "^")
    with pytest.raises(FieldError, match="is read by xgrammar as a negated class"):
        normalize_constraint("regex", pattern)


@pytest.mark.parametrize("pattern", ["^ab$", "^a|^b", "a$|b$", "[$^]x", r"a\$", r"\^a", "(ab)+", r"[a\^]", r"\Bx"])
def test_anchors_at_the_ends_and_characters_pass(pattern: str) -> None:
    check_regex(pattern)


def test_an_anchor_at_a_groups_end_is_refused_with_the_fix_in_the_message() -> None:
    with pytest.raises(FieldError) as info:
        check_regex("(a$)")
    assert info.value.message == (
        "'$' at position 2 is not enforced by xgrammar (only at the pattern's end, where the whole output must match "
        "it anyway)"
    )


AHEAD, BEHIND = "is not enforced by xgrammar (a lookahead)", "is not supported by xgrammar (a lookbehind)"


@pytest.mark.parametrize(
    ("pattern", "message"),
    [("(?=a)a", f"'(?=' at position 0 {AHEAD}"), ("b(?!b)a", f"'(?!' at position 1 {AHEAD}")]
    + [("a(?<=a)", f"'(?<=' at position 1 {BEHIND}"), ("((?<!a)b)", f"'(?<!' at position 1 {BEHIND}")],
)
def test_a_lookaround_is_refused(pattern: str, message: str) -> None:
    """xgrammar refuses one in a regex; a JSON schema's pattern it compiles dropping a lookahead, and refuses a
    lookbehind (test_json_schema_support), so the one check serves both."""
    with pytest.raises(FieldError, match=re.escape(f"field 'regex': {message}")):
        normalize_constraint("regex", pattern)


@pytest.mark.parametrize("pattern", [r"(?:ab)", r"\(?=a", "[(?=]a", "(?P<n>a)b", r"[\(]?!"])
def test_groups_and_characters_that_are_no_lookaround_pass(pattern: str) -> None:
    re.compile(pattern)  # each is valid Python, none a lookaround
    check_regex(pattern)


# (pattern, strings): xgrammar's grammar for the pattern as batchgen compiles it accepts exactly those of the
# strings that Python's re.fullmatch accepts (helper 82: xgrammar's own "." took newlines; a review: xgrammar read
# hex digits past \x's two, "\x011" as U+0011).
AS_PYTHON = [
    (r"[A-Z].{2,4}", ["Abc", "Ab\nc", "A\n\nb", "Abcde", "Ab"]),
    (r"a\.b.", ["a.bc", "axbc", "a.b\n"]),
    (r"[.]x.", [".xy", "zxy", ".x\n"]),
    (r"(a|.)+", ["ab", "a\nb", "\n"]),
    (r"\x011", ["\x011", "\x11", "\x01"]),
    (r"\x4142", ["A42", "\u4142", "A"]),
    (r"[\x41-\x431]+", ["AB1", "\u0431", "C", "D"]),
    (r"[\]\x41]x\\x41", ["Ax\\x41", "]x\\x41", "Ax\\A"]),
    # Octal escapes (helper 108: [\1] took "1", [\101]x "1x"), in and outside a class.
    (r"[\1]", ["\x01", "1"]),
    (r"[\101]x", ["Ax", "1x", "101x"]),
    (r"\01a\0", ["\x01a\x00", "1a0", "01a0"]),
    (r"\101\1012", ["AA2", "101A2"]),
    # Python's whitespace: U+001C-U+001F and U+0085 are, U+FEFF is not (helper 108).
    (r"a\sb", ["a b", "a\x1cb", "a\x85b", "a\ufeffb", "a\u3000b"]),
    (r"\S+", ["x\x1f", "\ufeff", "ab"]),
    (r"[\s,]+", [", \x1e", "\ufeff"]),
    # Escapes before hex digits in a class, where xgrammar read on past \u's four digits too (helper 110).
    (r"[\xe9a]", ["é", "a", "\u0e9a"]),
    (r"[\x01a]+", ["\x01a", "\x1a"]),
    (r"[0-9]+[\xb0C]", ["12°", "12C", "12\u0b0c"]),
    (r"[\1a]", ["\x01", "a", "\x1a"]),
    (r"[\u00e9a]", ["é", "a", "\u0e9a"]),
    # Escapes of regex syntax stand for themselves.
    (r"\x28\x5d[\x5d\x2d]", ["(]]", "(]-", "(]a"]),
    (r"\0\n[\b]", ["\x00\n\x08"]),
    # \s and \S in one class: both xgrammar's, which together take every character or none.
    (r"[\S\s]", ["\ufeff", "a", "\x1c"]),
    (r"a[^\s\S]?", ["a", "a\ufeff", "a "]),
]


@pytest.mark.parametrize(("pattern", "strings"), AS_PYTHON, ids=[d[0] for d in AS_PYTHON])
def test_a_pattern_reads_as_pythons_re_reads_it(pattern: str, strings: list[str], tmp_path: Path) -> None:
    """The grammar alone, and compiled for a tokenizer (which prints it and reads it again): the text whole, then
    the end id (1, </s>)."""
    grammar = constraint_grammar("regex", pattern)
    compiler = GrammarCompiler(build_tokenizer(tmp_path), 400)
    for text in strings:
        expected = bool(re.fullmatch(pattern, text))
        assert bool(_is_grammar_accept_string(grammar, text)) == expected, (pattern, text)
        matcher = compiler.matcher("regex", pattern, eos_ids=[1]).matcher
        assert (matcher.accept_string(text) and matcher.accept_token(1)) == expected, (pattern, text)


def test_a_pattern_pythons_re_refuses_is_refused() -> None:
    """The dialect is Python's: xgrammar read ``\\Q.\\E`` as the letters Q and E around any character (helper 83)."""
    with pytest.raises(
        FieldError, match=r"^field 'regex': does not compile as a Python regular expression: bad escape \\Q"
    ):
        normalize_constraint("regex", r"\Q.\E")
