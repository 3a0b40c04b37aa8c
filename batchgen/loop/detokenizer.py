"""Turn output token ids into the continuation text, incrementally, and find stop strings in it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# How many prompt tokens precede the output in the decoding window: enough for tokenizers whose decoding of a
# token depends on its left neighbour (SentencePiece's leading-space rule, byte-level merges).
_CONTEXT_TOKENS = 6
# How much further back the window may reach for a character's first byte (a UTF-8 character has at most 4).
_MORE_CONTEXT_TOKENS = 8


def continuation_text(tokenizer: Any, prompt_ids: Sequence[int], output_ids: Sequence[int], skip_special: bool) -> str:
    """``decode(prompt_ids + output_ids)`` minus its prefix ``decode(prompt_ids)``.

    This is the text as it reads after the prompt, with its leading space, which decoding the output alone
    would drop. Where the prompt ends inside a character (its decode ends in U+FFFD that the output completes),
    the longest common prefix is removed instead. The whole prompt is decoded, once per request: some decoders
    (byte fallback) replace a whole run of byte tokens when any of it is invalid, so no shorter window is exact.
    """
    before = tokenizer.decode(list(prompt_ids), skip_special_tokens=skip_special)
    full = tokenizer.decode(list(prompt_ids) + list(output_ids), skip_special_tokens=skip_special)
    if full.startswith(before):
        return full[len(before) :]
    return full[_common_prefix_len(before, full) :]


class IncrementalDetokenizer:
    """Keeps the continuation text of one request up to date as tokens arrive, decoding a short window only.

    Used to find stop strings as text appears. Each step decodes ``ids[prefix_offset:]`` and
    ``ids[prefix_offset:read_offset]`` and appends the difference (the offset scheme of vLLM's and SGLang's
    detokenizers). Text is committed only when it does not end in U+FFFD: a character whose bytes span several
    tokens appears whole once its last byte arrives, never as replacement characters (the fault of vLLM
    #8627). A request's final ``text`` is :func:`continuation_text` unless a stop string cut it here.
    """

    def __init__(
        self, tokenizer: Any, prompt_ids: Sequence[int], skip_special: bool, context_start: int | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        # Given for another sample of the same prompt, whose window is this one's.
        if context_start is None:
            context_start = _context_start(tokenizer, prompt_ids, skip_special)
        self.context_start = context_start
        self.ids = list(prompt_ids[context_start:])
        self.num_context = len(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    @property
    def committed_tokens(self) -> int:
        """How many output tokens have their text in :attr:`text`."""
        return self.read_offset - self.num_context

    def _pending_text(self) -> str:
        prefix = self.tokenizer.decode(
            self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special
        )
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip_special)
        return full[len(prefix) :] if full.startswith(prefix) else full[_common_prefix_len(prefix, full) :]

    def update(self, new_ids: Sequence[int]) -> str:
        """Add the newly generated ``new_ids``; return the text this commits (possibly empty)."""
        self.ids.extend(new_ids)
        pending = self._pending_text()
        if not pending or pending.endswith("\ufffd"):
            return ""
        self.text += pending
        # The tokens just read become the left context of the next window.
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return pending


def _context_start(tokenizer: Any, prompt_ids: Sequence[int], skip_special: bool) -> int:
    """Where the decoding window's prompt context starts: ``_CONTEXT_TOKENS`` before the prompt's end; where the
    text of those holds U+FFFD (they may begin inside a character), the nearest start up to ``_MORE_CONTEXT_TOKENS``
    further back whose text ends the whole prompt's text (else the first). A byte-fallback decoder writes a
    whole run of byte tokens as U+FFFD when any of it is invalid: a window from inside a prompt's last character
    would turn every byte token the output adds to that run into U+FFFD, and hide the stop strings in them."""

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=skip_special))

    start = max(0, len(prompt_ids) - _CONTEXT_TOKENS)
    if start == 0 or "\ufffd" not in decode(prompt_ids[start:]):
        return start
    whole = decode(prompt_ids)  # once per request, and only for a prompt that ends in such bytes
    for earlier in range(start, max(0, start - _MORE_CONTEXT_TOKENS) - 1, -1):
        if whole.endswith(decode(prompt_ids[earlier:])):
            return earlier
    return start


def _common_prefix_len(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def find_stop(text: str, new_len: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the last ``new_len`` characters of ``text``.

    Returns (start index of the match in ``text``, the stop string), or ``None``. Matches that lie entirely in
    older text are ignored: they were either checked before or held back by ``min_new_tokens``.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        pos = text.find(stop, start)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best
