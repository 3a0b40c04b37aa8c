"""Speculative decoding: the drafters behind ``batchgen.loop.drafter.Drafter``, and :func:`make_drafter`, the
factory the callers that build an ``Engine`` pass it."""

from __future__ import annotations

from batchgen.loop.drafter import Drafter
from batchgen.loop.model_runner import ModelRunner
from batchgen.loop.options import EngineOptions
from batchgen.speculative.draft_model import DraftModelDrafter
from batchgen.speculative.ngram import NgramDrafter


def make_drafter(options: EngineOptions, target: ModelRunner, cuda_graph_max_bs: int = 0) -> Drafter | None:
    """The drafter ``options.speculative_algorithm`` names, or ``None`` for plain decoding.

    ``target`` is the engine's runner: a draft model is loaded on its device in its dtype, with pools of its
    sizes; ``cuda_graph_max_bs`` is the target's graph runner setting, used for the draft's DECODE steps too.

    Raises:
        BatchgenError: a draft model that cannot be loaded or whose vocabulary differs from the target's (the
            options themselves are checked by :meth:`EngineOptions.validate`).
    """
    algorithm = options.speculative_algorithm
    if algorithm is None:
        return None
    if algorithm == "draft":
        assert options.speculative_draft_model is not None  # EngineOptions.validate checked it
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
