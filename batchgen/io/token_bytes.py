"""The bytes a token stands for, as OpenAI's chat logprobs report them in ``bytes``: a token holding part of a
multi-byte character decodes to U+FFFD alone, and OpenAI's API reference has ``bytes`` so that the bytes of such
tokens can be joined into the character."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from tokenizers import decoders
from transformers.convert_slow_tokenizer import bytes_to_unicode

# A SentencePiece byte-fallback piece (Llama 2, Mistral): one byte, written as its hex value.
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: the character a byte-level BPE piece writes for each byte."""
    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer: Any, token_id: int, text: str) -> list[int]:
    """The UTF-8 bytes of token ``token_id`` whose reported text is ``text``.

    ``text``'s own bytes, unless it holds U+FFFD (the token is part of a character) and the tokenizer says which
    bytes the token is: a byte-fallback piece ``<0xNN>``, or a piece of a byte-level BPE (GPT-2's byte alphabet:
    Llama 3, Qwen2, SmolLM2), whose characters map one to one onto bytes. Other tokenizers keep U+FFFD's bytes, as
    vLLM reports them for every tokenizer.
    """
    if "\ufffd" not in text or tokenizer is None:
        return list(text.encode("utf-8"))
    piece = str(tokenizer.convert_ids_to_tokens(token_id))
    match = _BYTE_PIECE.fullmatch(piece)
    if match:
        return [int(match.group(1), 16)]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    table = _byte_of_char()
    if backend is not None and isinstance(backend.decoder, decoders.ByteLevel) and all(c in table for c in piece):
        return [table[c] for c in piece]
    return list(text.encode("utf-8"))
