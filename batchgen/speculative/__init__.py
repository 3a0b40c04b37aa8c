"""Speculative decoding: drafters, and the verify rule the scheduler applies in TARGET_VERIFY rounds."""

from __future__ import annotations

from batchgen.errors import BatchgenError
from batchgen.loop.options import EngineOptions
from batchgen.speculative.ngram import NgramDrafter
from batchgen.speculative.verify import Drafter

SPECULATIVE_ALGORITHMS = ("ngram",)


def make_drafter(options: EngineOptions) -> Drafter | None:
    """The drafter ``options.speculative_algorithm`` names, or ``None`` for plain decoding.

    Raises:
        BatchgenError: an unknown algorithm, fewer than 1 draft token, or an empty n-gram range.
    """
    algorithm = options.speculative_algorithm
    if algorithm is None:
        return None
    if algorithm not in SPECULATIVE_ALGORITHMS:
        raise BatchgenError(
            f"--speculative-algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}, got '{algorithm}'"
        )
    if options.speculative_num_draft_tokens < 1:
        raise BatchgenError(f"--speculative-num-draft-tokens must be >= 1, got {options.speculative_num_draft_tokens}")
    low, high = options.speculative_ngram_min, options.speculative_ngram_max
    if not 1 <= low <= high:
        raise BatchgenError(f"--speculative-ngram-min/max must satisfy 1 <= min <= max, got {low} and {high}")
    return NgramDrafter(options.speculative_num_draft_tokens, low, high)
