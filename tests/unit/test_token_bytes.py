"""OpenAI's chat logprobs ``bytes``: the tokens of a text hold its UTF-8 bytes (the encoding's, from Python), also
where a token is only part of a character."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from batchgen.io.token_bytes import token_bytes
from tests.helpers.models import STORIES, needs_shared

TEXT = "Café, 日本語 🙂"


def _joined(tokenizer_dir: Path) -> tuple[bytes, list[str]]:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    texts = [tokenizer.decode([i]) for i in ids]
    return b"".join(bytes(token_bytes(tokenizer, i, t)) for i, t in zip(ids, texts)), texts


def test_byte_level_bpe_tokens_join_to_the_texts_bytes(random_models: dict[str, Path]) -> None:
    """The random llama's byte-level BPE (GPT-2's alphabet) splits the CJK characters and the emoji into pieces."""
    joined, texts = _joined(random_models["llama"])
    assert any("\ufffd" in text for text in texts)
    assert joined == TEXT.encode("utf-8")


@needs_shared
def test_byte_fallback_tokens_join_to_the_texts_bytes() -> None:
    """stories260k's SentencePiece writes the characters outside its vocabulary as <0xNN> pieces; a piece's leading
    space is the text decoding it alone drops, so the joined bytes are the text's without its first space."""
    joined, texts = _joined(STORIES)
    assert any("\ufffd" in text for text in texts)
    assert joined.replace(b" ", b"") == TEXT.encode("utf-8").replace(b" ", b"")


def test_a_whole_token_keeps_its_texts_bytes() -> None:
    assert token_bytes(None, 5, "é") == [0xC3, 0xA9]
    assert token_bytes(None, 5, "\ufffd") == [0xEF, 0xBF, 0xBD]
