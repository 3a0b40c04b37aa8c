"""Refuse regex anchors that xgrammar ignores.

A ``regex`` constraint must match the whole output, so ``^`` at its start and ``$`` at its end say nothing more;
elsewhere (``a$b``, ``x(^a)``) Python's ``re`` lets them match nowhere, while xgrammar drops them with only a log
line, and the row's output then does not match its pattern though it finishes with ``stop``.
"""

from __future__ import annotations

from batchgen.errors import FieldError


def check_anchors(pattern: str) -> None:
    """Refuse ``^`` or ``$`` in ``pattern`` other than at its start or end, or at those of a top-level alternative
    (``^a|^b``, ``a$|b$``); escaped ones and those inside a character class are characters.

    Raises:
        FieldError: (``regex``) naming the anchor and its position.
    """
    depth, i = 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i = _class_end(pattern, i)
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c in "^$":
            before, after = pattern[i - 1 : i], pattern[i + 1 : i + 2]
            edge = before in ("", "|") if c == "^" else after in ("", "|")
            if not edge or depth != 0:
                where = "start" if c == "^" else "end"
                raise FieldError(
                    "regex",
                    f"'{c}' at position {i} is not enforced by xgrammar (only at the pattern's {where}, where the "
                    "whole output must match it anyway)",
                )
        i += 1


def _class_end(pattern: str, start: int) -> int:
    """The index just past the character class that opens at ``start`` (a ``]`` first in it, after an optional
    ``^``, is a character)."""
    i = start + 1
    if pattern[i : i + 1] == "^":
        i += 1
    if pattern[i : i + 1] == "]":
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1
