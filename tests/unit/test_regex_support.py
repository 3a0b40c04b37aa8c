"""Regex anchors xgrammar ignores are refused; the outside reference is Python's ``re``: each refused pattern
fully matches nothing that xgrammar's grammar accepts for it."""

from __future__ import annotations

import re

import pytest

from batchgen.errors import FieldError
from batchgen.sampling.grammar import normalize_constraint
from batchgen.sampling.regex_support import check_anchors

xgrammar = pytest.importorskip("xgrammar", reason='grammars need xgrammar (pip install -e ".[structured]")')
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

# (pattern, a string xgrammar accepts for it that re.fullmatch rejects, the refused anchor's position)
IGNORED = [("a$b", "ab", 1), ("x(^a)", "xa", 2), ("a^b", "ab", 1), (r"a\|^b", "a|b", 3)]


@pytest.mark.parametrize(("pattern", "text", "position"), IGNORED)
def test_an_anchor_inside_the_pattern_is_refused(pattern: str, text: str, position: int) -> None:
    assert re.fullmatch(pattern, text) is None
    assert _is_grammar_accept_string(xgrammar.Grammar.from_regex(pattern), text)
    with pytest.raises(FieldError, match=re.escape(f"field 'regex': '{pattern[position]}' at position {position} ")):
        normalize_constraint("regex", pattern)


# xgrammar reads these otherwise than Python's re (helper 64): \A and \Z as letters, [\^...] as a negated class.
MISREAD = [(r"\Aab\Z", "AabZ", "'\\A' at position 0 is not supported"), (r"[\^]x", ",x", "'[\\^' at position 0")]


@pytest.mark.parametrize(("pattern", "text", "message"), MISREAD)
def test_what_xgrammar_reads_otherwise_is_refused(pattern: str, text: str, message: str) -> None:
    assert re.fullmatch(pattern, text) is None
    assert _is_grammar_accept_string(xgrammar.Grammar.from_regex(pattern), text)
    with pytest.raises(FieldError, match=re.escape(f"field 'regex': {message}")):
        normalize_constraint("regex", pattern)


@pytest.mark.parametrize(
    "pattern", ["^ab$", "^a|^b", "a$|b$", "[$^]x", r"a\$", r"\^a", "[^]$]+", "(ab)+", r"[a\^]", r"\Bx"]
)
def test_anchors_at_the_ends_and_characters_pass(pattern: str) -> None:
    check_anchors(pattern)


def test_an_anchor_at_a_groups_end_is_refused_with_the_fix_in_the_message() -> None:
    with pytest.raises(FieldError) as info:
        check_anchors("(a$)")
    assert info.value.message == (
        "'$' at position 2 is not enforced by xgrammar (only at the pattern's end, where the whole output must match "
        "it anyway)"
    )
