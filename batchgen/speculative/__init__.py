"""Speculative decoding: drafters, and the verify rule the scheduler applies in TARGET_VERIFY rounds."""

from __future__ import annotations

from batchgen.errors import BatchgenError
from batchgen.loop.model_runner import ModelRunner
from batchgen.loop.options import EngineOptions
from batchgen.speculative.draft_model import DraftModelDrafter
from batchgen.speculative.ngram import NgramDrafter
from batchgen.speculative.verify import Drafter

SPECULATIVE_ALGORITHMS = ("ngram", "draft")
SPECULATIVE_ACCEPTANCES = ("rejection", "coupled")


def check_speculative_options(options: EngineOptions) -> None:
    """Reject inconsistent speculative options before any model is loaded.

    Raises:
        BatchgenError: an unknown algorithm, fewer than 1 draft token, an empty n-gram range, ``draft`` without
            ``speculative_draft_model``, a draft model with another algorithm, or an unknown acceptance rule.
    """
    algorithm = options.speculative_algorithm
    if algorithm is not None and algorithm not in SPECULATIVE_ALGORITHMS:
        raise BatchgenError(
            f"--speculative-algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}, got '{algorithm}'"
        )
    if algorithm != "draft" and options.speculative_draft_model is not None:
        raise BatchgenError("--speculative-draft-model needs --speculative-algorithm draft")
    # The other values are checked with speculation off too: a bad value is a mistake whether or not it is used.
    if options.speculative_acceptance not in SPECULATIVE_ACCEPTANCES:
        raise BatchgenError(
            f"--speculative-acceptance must be one of {', '.join(SPECULATIVE_ACCEPTANCES)}, "
            f"got '{options.speculative_acceptance}'"
        )
    if options.speculative_num_draft_tokens < 1:
        raise BatchgenError(f"--speculative-num-draft-tokens must be >= 1, got {options.speculative_num_draft_tokens}")
    low, high = options.speculative_ngram_min, options.speculative_ngram_max
    if not 1 <= low <= high:
        raise BatchgenError(f"--speculative-ngram-min/max must satisfy 1 <= min <= max, got {low} and {high}")
    if algorithm == "draft" and not options.speculative_draft_model:
        raise BatchgenError("--speculative-algorithm draft needs --speculative-draft-model PATH")


def make_drafter(options: EngineOptions, target: ModelRunner, cuda_graph_max_bs: int = 0) -> Drafter | None:
    """The drafter ``options.speculative_algorithm`` names, or ``None`` for plain decoding.

    ``target`` is the engine's runner: a draft model is loaded on its device in its dtype, with pools of its
    sizes; ``cuda_graph_max_bs`` is the target's graph runner setting, used for the draft's DECODE steps too.

    Raises:
        BatchgenError: bad options (see :func:`check_speculative_options`), or a draft model that cannot be
            loaded or whose vocabulary differs from the target's.
    """
    check_speculative_options(options)
    algorithm = options.speculative_algorithm
    if algorithm is None:
        return None
    if algorithm == "draft":
        assert options.speculative_draft_model is not None  # checked above
        return DraftModelDrafter(
            options.speculative_draft_model,
            options.speculative_num_draft_tokens,
            target,
            options.attention_backend,
            cuda_graph_max_bs,
            options.speculative_acceptance,
        )
    return NgramDrafter(
        options.speculative_num_draft_tokens, options.speculative_ngram_min, options.speculative_ngram_max
    )
