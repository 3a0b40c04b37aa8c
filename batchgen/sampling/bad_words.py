"""vLLM's ``bad_words``: words a row's output may not contain, as token sequences whose last token is banned where
the output ends with the rest of the sequence (vLLM's ``SamplingParams.update_from_tokenizer`` and its bad-words
logits processor). One change from vLLM: a word's spaced form counts also where it is another number of tokens
(vLLM keeps it only at the same count, so ``delve`` with SmolLM2's tokenizer, ``d elve`` alone and ``Ġdelve`` after a
space, did not ban `` delve``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def bad_word_sequences(tokenizer: Any, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences of ``words``: each word as encoded alone (leading whitespace stripped, no special tokens),
    and again after a space where that gives other tokens (the word in the middle of a text, for tokenizers that
    mark a word's leading space in its first token).

    Raises:
        ValueError: a word that encodes to no tokens.
    """
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not alone:
            raise ValueError(f"{word!r} encodes to no tokens")
        sequences.append(alone)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced != alone:
            sequences.append(spaced)
    return tuple(sequences)


def bad_word_bans(
    sequences: Sequence[Sequence[int]], output_ids: Sequence[int], drafted: Sequence[int] = ()
) -> list[int]:
    """The ids a row may not pick next: each sequence's last token where the output (``output_ids`` then the
    ``drafted`` ids a verify or draft round puts after them) ends with the sequence's other tokens (a one-token
    sequence: always). Only the output counts, as in vLLM: a word begun in the prompt is not."""
    if not sequences:
        return []
    longest = max(len(sequence) for sequence in sequences) - 1
    recent = [*output_ids[max(len(output_ids) - longest, 0) :], *drafted]  # all a sequence can look back on
    banned = set()
    for sequence in sequences:
        head = len(sequence) - 1
        if head == 0 or (head <= len(recent) and recent[len(recent) - head :] == list(sequence[:-1])):
            banned.add(sequence[-1])
    return sorted(banned)
