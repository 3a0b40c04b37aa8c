"""Constrained rows never produce UTF-8-encoded surrogates (bytes ED A0-BF ..), which xgrammar's character
classes let through. Reference: Python's UTF-8 codec (RFC 3629) on the bytes the mask allows."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchgen.sampling.grammar import GrammarCompiler, grammar_bitmask
from tests.helpers.models import build_tokenizer

xgrammar = pytest.importorskip("xgrammar", reason='grammars need xgrammar (pip install -e ".[structured]")')


def _allowed(state: object, vocab: int) -> list[bool]:
    bitmask = grammar_bitmask([state], vocab)  # type: ignore[list-item]
    assert bitmask is not None
    return [bool((int(bitmask[0, i // 32]) >> (i % 32)) & 1) for i in range(vocab)]


@pytest.mark.parametrize(("kind", "text"), [("json_schema", '{"type": "string"}'), ("regex", '"[^"]*"')])
def test_after_a_lead_ed_byte_only_utf8_may_follow(kind: str, text: str, tmp_path: Path) -> None:
    tokenizer = build_tokenizer(tmp_path)
    vocab = len(tokenizer)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    single = {data[0]: i for i, data in enumerate(info.decoded_vocab) if len(data) == 1}  # one token per byte
    state = GrammarCompiler(tokenizer, vocab).matcher(kind, text, eos_ids={1})
    assert state.accept(single[ord('"')]) and state.accept(single[0xED])
    allowed = _allowed(state, vocab)
    for second in range(0x80, 0xC0):
        try:
            bytes([0xED, second, 0x80]).decode("utf-8")
            valid = True
        except UnicodeDecodeError:
            valid = False
        assert allowed[single[second]] == valid, hex(second)
    # A valid character after all (U+D7FF: ED 9F BF), then the lead byte is history.
    assert state.accept(single[0x9F]) and state.accept(single[0xBF])
    assert _allowed(state, vocab)[single[0xA0]] is False  # a lone continuation byte: xgrammar's own rule
    fork = state.fork()
    assert fork.accept(single[0xED]) and not _allowed(fork, vocab)[single[0xA0]]
    assert fork.accept(single[0x80]) and fork.accept(single[0x80]) and fork.accept(single[ord('"')])
