"""Refuse regex anchors and lookarounds that xgrammar ignores, and read ``.`` and escapes as Python's ``re`` does.

A ``regex`` constraint must match the whole output, so ``^`` at its start and ``$`` at its end say nothing more;
elsewhere (``a$b``, ``x(^a)``) Python's ``re`` lets them match nowhere, while xgrammar drops them with only a log
line, and the row's output then does not match its pattern though it finishes with ``stop``. xgrammar's ``.``
takes a newline too, which Python's (without ``re.DOTALL``) does not.
"""

from __future__ import annotations

import re

from batchgen.errors import FieldError


def check_regex(pattern: str) -> None:
    """Refuse ``^`` or ``$`` in ``pattern`` other than at its start or end, or at those of a top-level alternative
    (``^a|^b``, ``a$|b$``); escaped ones and those inside a character class are characters. Refuse too the anchors
    xgrammar reads as letters (``\\A``, ``\\Z``, ``\\z``) and an escaped ``^`` first in a class, which it reads
    as a negation (``[\\^]``), and lookarounds (``(?=``, ``(?!``, ``(?<=``, ``(?<!``), which xgrammar refuses in a
    regex but drops from a JSON schema's ``pattern``.

    Raises:
        FieldError: (``regex``) naming the anchor or lookaround and its position.
    """
    depth, i, alternative_starts = 0, 0, True  # the pattern's start is a top-level alternative's
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            letter = pattern[i + 1 : i + 2]
            if letter in ("A", "Z", "z"):
                raise FieldError(
                    "regex",
                    f"'\\{letter}' at position {i} is not supported by xgrammar (it reads the letter {letter}; the "
                    "whole output must match the pattern anyway)",
                )
            i, alternative_starts = i + 2, False
            continue
        if c == "[":
            # \^ first in a class, or an escape python_regex writes so (\x5e, \136, \U0000005e...; a helper)
            escaped = _escaped_char(pattern, i + 1, in_class=True) if pattern[i + 1 : i + 2] == "\\" else None
            if pattern[i + 1 : i + 3] == "\\^" or (escaped is not None and escaped[0] == "^"):
                written = pattern[i + 1 : i + 1 + (escaped[1] if escaped is not None else 2)]
                raise FieldError(
                    "regex",
                    f"'[{written}' at position {i} is read by xgrammar as a negated class: put the ^ later in it (or "
                    "write \\^ outside a class)",
                )
            if pattern[i + 1 : i + 3] == "^]":
                raise FieldError(
                    "regex", f"'[^]' at position {i} is read by xgrammar as any character: escape the ] (\\])"
                )
            i, alternative_starts = _class_end(pattern, i), False
            continue
        if c == "(":
            look = next((s for s in ("?<=", "?<!", "?=", "?!") if pattern.startswith(s, i + 1)), None)
            if look is not None:  # xgrammar refuses them in a regex; a JSON schema's pattern drops a lookahead
                why = "supported by xgrammar (a lookbehind)" if look[1] == "<" else "enforced by xgrammar (a lookahead)"
                raise FieldError("regex", f"'({look}' at position {i} is not {why}")
            depth += 1
        elif c == ")":
            depth -= 1
        elif c in "^$":
            edge = alternative_starts if c == "^" else pattern[i + 1 : i + 2] in ("", "|")
            if not edge or depth != 0:
                where = "start" if c == "^" else "end"
                raise FieldError(
                    "regex",
                    f"'{c}' at position {i} is not enforced by xgrammar (only at the pattern's {where}, where the "
                    "whole output must match it anyway)",
                )
        alternative_starts = c == "|" and depth == 0
        i += 1


def check_json_string_pattern(pattern: str) -> None:
    """Refuse a JSON schema ``pattern`` that names a quote, a backslash or a control character as itself (a literal,
    an escape such as ``\\"``, ``\\\\``, ``\\x22``, ``\\n``, or a class of it alone, ``["]``): xgrammar writes
    it into the JSON string as it is, unescaped, so the output does not parse (a helper: ``^a"$`` gave ``"a""``).
    A class of only such characters with a quote or backslash among them (``["\\\\]``) too; any other class
    (``[a"]``, ``[ -~]``, ``[^a]``, ``.``) is fine: xgrammar leaves such characters out of it.

    Raises:
        FieldError: (``regex``) naming the character and its position.
    """
    i = 0
    while i < len(pattern):
        if pattern[i] == "[":
            end = _class_end(pattern, i)
            # xgrammar leaves the quote, backslash and control characters out of a class that takes another
            # character, and writes them raw from one that takes only such (["], ["\\]; helpers 110 and 111).
            chars = _class_chars(pattern, i, end)
            if chars and all(c in '"\\' or ord(c) < 0x20 for c in chars) and not chars.isdisjoint('"\\'):
                _refuse_json_special(min(chars & set('"\\')), i)
            i = end
            continue
        char, size = _char_at(pattern, i)
        _refuse_json_special(char, i)
        i += size


def _class_chars(pattern: str, start: int, end: int) -> set[str] | None:
    """The characters the class ``pattern[start:end]`` takes (``[""]``, ``["-"]``: one), or ``None`` for a negated
    class, one with a class escape (``\\d``) or one of over 256 characters."""
    if pattern[start + 1 : start + 2] == "^":
        return None
    chars: set[str] = set()
    j = start + 1
    while j < end - 1:
        low, size = _char_at(pattern, j)
        j += size
        if pattern[j : j + 1] == "-" and j + 1 < end - 1:
            high, size = _char_at(pattern, j + 1)
            j += 1 + size
            if low is None or high is None or ord(high) - ord(low) > 256:
                return None
            chars.update(chr(c) for c in range(ord(low), ord(high) + 1))
        elif low is None:
            return None
        else:
            chars.add(low)
    return chars


def _char_at(pattern: str, i: int) -> tuple[str | None, int]:
    """The one character that the literal or escape at ``pattern[i]`` of a JSON schema's pattern stands for to
    xgrammar, which writes it (``\\0`` a NUL alone, no octal: :func:`_escaped_char` reads a regex row's as Python's
    ``re`` does), or ``None`` for a class escape, an anchor or a back reference (``\\d``, ``\\b``, ``\\1``); and
    its length in the pattern."""
    if pattern[i] != "\\":
        return pattern[i], 1
    letter = pattern[i + 1 : i + 2]
    found = _hex_char(pattern, i, {"x": 2, "u": 4})
    if found is not None:
        return found
    controls = _LETTER_CONTROLS | {"0": "\0"}
    if letter in controls:
        return controls[letter], 2
    return (letter if letter and not letter.isalnum() else None), 2


def _hex_char(pattern: str, i: int, digits_after: dict[str, int]) -> tuple[str, int] | None:
    """The character of the hex escape at ``pattern[i]`` (a backslash, a letter of ``digits_after`` and that many hex
    digits) and the escape's length; ``None`` for another escape or a code past U+10FFFF."""
    digits = digits_after.get(pattern[i + 1 : i + 2], 0)
    code = pattern[i + 2 : i + 2 + digits]
    if digits and len(code) == digits and _HEX_DIGITS.issuperset(code) and int(code, 16) <= 0x10FFFF:
        return chr(int(code, 16)), 2 + digits
    return None


def _refuse_json_special(char: str | None, position: int) -> None:
    if char is not None and (char in '"\\' or ord(char) < 0x20):
        raise FieldError(
            "regex",
            f"{char!r} at position {position} is written by xgrammar into the JSON string as it is, unescaped, so the "
            "output would not parse: a pattern may not name a quote, a backslash or a control character alone",
        )


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


_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
# Control characters escaped by a letter, read so by Python's re and by xgrammar.
_LETTER_CONTROLS = {"a": "\a", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}
# The characters xgrammar reads by these escapes, as Python does (a NUL or a newline as itself it refuses).
_XGRAMMAR_ESCAPES = {"\0": "\\0", "\t": "\\t", "\n": "\\n", "\r": "\\r", "\f": "\\f", "\v": "\\v"}
# Characters of regex syntax, escaped where they stand for themselves: outside a class, and in one.
_SYNTAX = frozenset(".^$*+?()[]{}|\\")
_CLASS_SYNTAX = frozenset("]\\^-[")
# Python's whitespace, what re's \s takes in a str pattern (str.isspace); xgrammar's \s takes U+FEFF and leaves out
# U+001C-U+001F and U+0085 (a helper).
_PYTHON_SPACE = "\\t-\\r\\u001c-\\u0020\\u0085\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"


def python_regex(pattern: str) -> str:
    r"""``pattern`` rewritten so that xgrammar reads it as Python's ``re`` does: each ``.`` that is no escaped
    character nor in a character class as ``[^\n]``, any character but a newline (xgrammar's takes a newline too: a
    row's output held newlines its pattern's ``re.fullmatch`` refused); each escape of one character (``\xHH``,
    ``\uHHHH``, octal, ``\a``...) as that character, since xgrammar reads on past ``\x``'s two hex digits and, in a
    class, past ``\u``'s four (``\x011`` was U+0011 where ``re`` reads U+0001 and "1"; a review), and octal escapes
    as digits; and ``\s`` (``\S`` outside a class) as Python's whitespace class (a helper)."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            text, size = _python_escape(pattern, i, in_class=False)
            out.append(text)
            i += size
        elif c == "[":
            end = _class_end(pattern, i)
            # A class with \S keeps xgrammar's \s beside it: Python's \s and xgrammar's \S together would both miss
            # or both take U+FEFF ([^\s\S] took it: a test).
            spaces = _class_escapes(pattern, i, end).isdisjoint("S")
            j = i
            while j < end:
                escape = pattern[j] == "\\"
                text, size = _python_escape(pattern, j, in_class=True, spaces=spaces) if escape else (pattern[j], 1)
                out.append(text)
                j += size
            i = end
        else:
            out.append("[^\\n]" if c == "." else c)
            i += 1
    return "".join(out)


def _class_escapes(pattern: str, start: int, end: int) -> set[str]:
    """The letters escaped in the class ``pattern[start:end]`` (``{"s", "d"}`` for ``[\\s\\d,]``)."""
    letters, j = set(), start + 1
    while j < end - 1:
        if pattern[j] == "\\":
            letters.add(pattern[j + 1])
            j += 2
        else:
            j += 1
    return letters


def _python_escape(pattern: str, i: int, in_class: bool, spaces: bool = True) -> tuple[str, int]:
    r"""The escape at ``pattern[i]`` (a backslash) as xgrammar must read it (:func:`python_regex`), and its length;
    ``\s`` as Python's where ``spaces``."""
    letter = pattern[i + 1 : i + 2]
    if letter == "s" and spaces:
        return (_PYTHON_SPACE if in_class else f"[{_PYTHON_SPACE}]"), 2
    if letter == "S" and not in_class:
        return f"[^{_PYTHON_SPACE}]", 2
    found = _escaped_char(pattern, i, in_class)
    if found is None:
        return pattern[i : i + 2], 2
    char, size = found
    if char in _XGRAMMAR_ESCAPES:
        return _XGRAMMAR_ESCAPES[char], size
    if 0xD800 <= ord(char) <= 0xDFFF:  # no UTF-8 of its own: left to xgrammar's escape
        return f"\\u{ord(char):04x}", size
    # The character itself: xgrammar reads the hex digits after a \x or \u escape on in a class, and on past \x's two
    # outside one ("[\xe9a]" took U+0E9A; helper 110).
    return ("\\" + char if char in (_CLASS_SYNTAX if in_class else _SYNTAX) else char), size


def _escaped_char(pattern: str, i: int, in_class: bool) -> tuple[str, int] | None:
    r"""The one character Python's ``re`` reads for the escape at ``pattern[i]`` (``\xHH``, ``\uHHHH``,
    ``\UHHHHHHHH``, octal, ``\a``, ``\f``, ``\n``, ``\r``, ``\t``, ``\v``, and ``\b`` in a class) and the escape's
    length; ``None`` for any other escape."""
    letter = pattern[i + 1 : i + 2]
    found = _hex_char(pattern, i, {"x": 2, "u": 4, "U": 8})
    if found is not None:
        return found
    # Python's octal escapes: in a class up to three digits; outside one, 0 and up to two more, or three digits
    # (one or two digits from 1 on are a group reference there).
    octal = re.match("[0-7]{1,3}" if in_class else "0[0-7]{0,2}|[0-7]{3}", pattern[i + 1 : i + 4])
    if octal:
        return chr(int(octal[0], 8)), 1 + len(octal[0])
    simple = _LETTER_CONTROLS | ({"b": "\b"} if in_class else {})
    return (simple[letter], 2) if letter in simple else None
