"""Engine flags that ``batchgen run`` and ``batchgen bench`` share: one definition and one help text each."""

from __future__ import annotations

import typer

from batchgen.errors import BatchgenError
from batchgen.loop.options import EngineOptions

_DEFAULTS = EngineOptions(model="")

DISABLE_CUDA_GRAPH = typer.Option(
    _DEFAULTS.disable_cuda_graph, "--disable-cuda-graph", help="Run decode rounds eagerly at their own size."
)
CUDA_GRAPH_MAX_BS = typer.Option(
    None, help="Largest decode batch replayed from a CUDA graph (default 256; on CPU: off, N pads eagerly)."
)
SPECULATIVE_ALGORITHM = typer.Option(
    None,
    help="Speculative decoding: ngram (drafts from the sequence's own earlier text) or draft (a draft model "
    "proposes); default off.",
)
SPECULATIVE_NUM_DRAFT_TOKENS = typer.Option(
    _DEFAULTS.speculative_num_draft_tokens, help="Draft tokens per request per round (K)."
)
SPECULATIVE_NGRAM_MIN = typer.Option(
    _DEFAULTS.speculative_ngram_min, help="Shortest suffix the n-gram drafter looks up."
)
SPECULATIVE_NGRAM_MAX = typer.Option(
    _DEFAULTS.speculative_ngram_max, help="Longest suffix the n-gram drafter looks up."
)
SPECULATIVE_DRAFT_MODEL = typer.Option(
    None, help="Draft model of --speculative-algorithm draft (same vocabulary as --model; or random:PRESET)."
)
SPECULATIVE_ACCEPTANCE = typer.Option(
    _DEFAULTS.speculative_acceptance,
    help="How sampled rows verify a draft model's drafts: rejection (rejection sampling, most accepted) or "
    "coupled (outputs identical to plain decoding with the same seeds).",
)


def check_engine_limits(
    max_running_requests: int | None, max_prefill_tokens: int | None, chunked_prefill_size: int | None
) -> None:
    """Range checks of the batch-size flags ``run`` and ``bench`` share (``None``: the engine's default).

    Raises:
        BatchgenError: naming the first bad flag.
    """
    for name, value in (("max_running_requests", max_running_requests), ("max_prefill_tokens", max_prefill_tokens)):
        if value is not None and value < 1:
            raise BatchgenError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if chunked_prefill_size is not None and chunked_prefill_size < 0:
        raise BatchgenError(f"--chunked-prefill-size must be >= 0, got {chunked_prefill_size}")
