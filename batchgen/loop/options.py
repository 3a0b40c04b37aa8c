"""Engine options: everything ``batchgen run`` and the benchmarks pass down to the loop."""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.errors import BatchgenError


@dataclass(frozen=True)
class EngineOptions:
    """How to load the model and size the loop.

    Attributes:
        model: a model directory, a .gguf file, a built-in name or a hub id (see ``resolve_model``).
        dtype: ``auto`` (the checkpoint's dtype; float32 when it names none, or float16 on CPU), ``float32``,
            ``bfloat16`` or ``float16``.
        device: ``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.
        context_length: longest prompt + output in tokens; ``None`` = the model's ``max_position_embeddings``.
        max_total_tokens: KV pool size in tokens; ``None`` = sized from ``mem_fraction``.
        mem_fraction: share of the memory available after loading the weights given to the KV pool.
        chunked_prefill_size: longest prefill chunk per round (0 = no chunking).
        max_prefill_tokens: prompt tokens per round.
        max_running_requests: requests decoding together; ``None`` = 64 on CPU (where larger batches cost more
            per token: their KV gathers outgrow the caches), 256 on GPU.
        attention_backend: ``auto`` or a backend name.
        enable_mixed_chunk: run prefill chunks and decodes in one forward (MIXED rounds).
        disable_cuda_graph: run DECODE rounds eagerly at their own size, without the graph runner.
        cuda_graph_max_bs: the largest DECODE batch the graph runner serves (capped by max_running_requests);
            on CUDA it captures graphs for sizes 1, 2, 4, 8, 16, 24, … up to it, on CPU it pads eagerly.
            ``None`` = 256 on CUDA, and off on CPU, where padding only adds work.
        speculative_algorithm: ``None`` (plain decoding), ``ngram`` or ``draft`` (a draft model proposes).
        speculative_num_draft_tokens: drafts per request per round (K); verify rounds score K + 1 positions.
        speculative_ngram_min, speculative_ngram_max: suffix lengths the n-gram drafter looks up, longest first.
        speculative_draft_model: the draft model for ``draft`` (a spec as ``model``, same vocabulary); it runs on
            ``device`` in the target's dtype.
        speculative_acceptance: how sampled rows verify a draft model's drafts: ``rejection`` (rejection sampling,
            the highest acceptance) or ``coupled`` (outputs identical to plain decoding with the same seeds).
        seed: run seed; rows without a ``seed`` get one derived from it and their ``id``.
        logprobs_mode: ``raw`` (log_softmax of the model's logits) or ``processed`` (of the distribution sampled
            from, after bias, penalties, temperature and truncation).
    """

    model: str
    dtype: str = "auto"
    device: str = "auto"
    context_length: int | None = None
    max_total_tokens: int | None = None
    mem_fraction: float = 0.4
    chunked_prefill_size: int = 2048
    max_prefill_tokens: int = 8192
    max_running_requests: int | None = None
    attention_backend: str = "auto"
    enable_mixed_chunk: bool = True
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4
    speculative_ngram_min: int = 2
    speculative_ngram_max: int = 4
    speculative_draft_model: str | None = None
    speculative_acceptance: str = "rejection"
    seed: int | None = None
    logprobs_mode: str = "raw"


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
