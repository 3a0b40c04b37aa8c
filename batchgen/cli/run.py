"""``batchgen run``: the command's options, their checks, and the job it starts."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import typer

from batchgen.cli.config import load_config
from batchgen.cli.options import (
    CUDA_GRAPH_MAX_BS,
    DISABLE_CUDA_GRAPH,
    SPECULATIVE_ACCEPTANCE,
    SPECULATIVE_ALGORITHM,
    SPECULATIVE_DRAFT_MODEL,
    SPECULATIVE_NGRAM_MAX,
    SPECULATIVE_NGRAM_MIN,
    SPECULATIVE_NUM_DRAFT_TOKENS,
    check_engine_limits,
)
from batchgen.cli.user_errors import user_errors
from batchgen.errors import BatchgenError, FieldError
from batchgen.job.summary import peak_rss_mib
from batchgen.kernels.attention import ATTENTION_BACKENDS
from batchgen.loop.options import EngineOptions
from batchgen.models.resolve import DEFAULT_MODEL
from batchgen.sampling.sampling_params import SamplingParams

_ENGINE_DEFAULTS = EngineOptions(model=DEFAULT_MODEL)
_SAMPLING_DEFAULTS = SamplingParams()


def _check_run_options(
    on_error: str,
    max_running_requests: int | None,
    max_prefill_tokens: int,
    chunked_prefill_size: int,
    seed: int | None,
    context_length: int | None,
    mem_fraction: float,
) -> None:
    """Range checks of ``run``'s engine options (sampling defaults are checked like a row's, by SamplingParams).

    Raises:
        BatchgenError: naming the first bad option.
    """
    if on_error not in ("fail", "skip"):
        raise BatchgenError(f"--on-error must be fail or skip, got '{on_error}'")
    check_engine_limits(max_running_requests, max_prefill_tokens, chunked_prefill_size)
    if seed is not None and not 0 <= seed < 2**63:
        raise BatchgenError(f"--seed must be in [0, 2**63), got {seed}")
    if context_length is not None and context_length < 2:
        raise BatchgenError(f"--context-length must be >= 2, got {context_length}")
    if not 0.0 < mem_fraction < 1.0:
        raise BatchgenError(f"--mem-fraction must be in (0, 1), got {mem_fraction}")


def _check_sampling_defaults(defaults: SamplingParams, vocab_size: int | None) -> None:
    """Validate the sampling defaults (against the model's vocabulary once it is known; ``None``: the checks that
    need none).

    Raises:
        BatchgenError: naming the option.
    """
    try:
        defaults.validate(vocab_size if vocab_size is not None else sys.maxsize)
    except FieldError as e:
        raise BatchgenError(f"--{e.field.replace('_', '-')}: {e.message}") from None


def run(
    ctx: typer.Context,
    dataset: Path = typer.Argument(
        ..., metavar="DATASET", help="Prompts: .jsonl (one JSON object per line) or .parquet."
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Results: .arrow (Arrow IPC file), .parquet or .jsonl."),
    model: str = typer.Option(DEFAULT_MODEL, help="Model directory, .gguf file, built-in name or Hugging Face hub id."),
    config: Path | None = typer.Option(
        None, help="YAML file of option defaults (keys as the long flags).", is_eager=True, callback=load_config
    ),
    dtype: str = typer.Option(_ENGINE_DEFAULTS.dtype, help="auto, float32, bfloat16 or float16."),
    device: str = typer.Option(_ENGINE_DEFAULTS.device, help="auto, cpu, cuda or cuda:N."),
    max_new_tokens: int = typer.Option(_SAMPLING_DEFAULTS.max_new_tokens, help="Default per row."),
    min_new_tokens: int = typer.Option(_SAMPLING_DEFAULTS.min_new_tokens, help="Default per row."),
    temperature: float = typer.Option(_SAMPLING_DEFAULTS.temperature, help="Default per row; 0 = greedy."),
    top_p: float = typer.Option(_SAMPLING_DEFAULTS.top_p, help="Default per row, in (0, 1]."),
    top_k: int = typer.Option(_SAMPLING_DEFAULTS.top_k, help="Default per row; -1 or 0 = off."),
    min_p: float = typer.Option(_SAMPLING_DEFAULTS.min_p, help="Default per row, in [0, 1]."),
    stop: list[str] = typer.Option([], help="Default stop string (repeat for several)."),
    stop_token_ids: list[int] = typer.Option([], help="Default stop token id (repeat for several)."),
    ignore_eos: bool = typer.Option(_SAMPLING_DEFAULTS.ignore_eos, help="Default per row."),
    skip_special_tokens: bool = typer.Option(_SAMPLING_DEFAULTS.skip_special_tokens, help="Default per row."),
    logprobs: bool = typer.Option(_SAMPLING_DEFAULTS.logprobs, help="Report each output token's raw logprob."),
    top_logprobs: int = typer.Option(_SAMPLING_DEFAULTS.top_logprobs, help="Report the N most likely tokens."),
    n: int = typer.Option(_SAMPLING_DEFAULTS.n, "--n", help="Default per row: samples per prompt (one row each)."),
    seed: int | None = typer.Option(None, help="Run seed: rows without a seed get one derived from it and their id."),
    prompt_logprobs: int | None = typer.Option(
        None, help="Default per row: report prompt logprobs with the N most likely tokens (0 = just the token's)."
    ),
    logprobs_mode: str = typer.Option(
        "raw", help="raw: log_softmax of the model's logits; processed: of the distribution sampled from."
    ),
    repetition_penalty: float = typer.Option(_SAMPLING_DEFAULTS.repetition_penalty, help="Default per row (HF)."),
    frequency_penalty: float = typer.Option(_SAMPLING_DEFAULTS.frequency_penalty, help="Default per row, in [-2, 2]."),
    presence_penalty: float = typer.Option(_SAMPLING_DEFAULTS.presence_penalty, help="Default per row, in [-2, 2]."),
    context_length: int | None = typer.Option(None, help="Longest prompt + output (default: the model's)."),
    max_total_tokens: int | None = typer.Option(None, help="KV pool size in tokens (default: from --mem-fraction)."),
    mem_fraction: float = typer.Option(_ENGINE_DEFAULTS.mem_fraction, help="Share of free memory for the KV pool."),
    chunked_prefill_size: int = typer.Option(
        _ENGINE_DEFAULTS.chunked_prefill_size, help="Longest prefill chunk per round; 0 = no chunking."
    ),
    max_prefill_tokens: int = typer.Option(_ENGINE_DEFAULTS.max_prefill_tokens, help="Prompt tokens per round."),
    max_running_requests: int | None = typer.Option(
        None, help="Requests decoding together (default: 64 on CPU, 256 on GPU)."
    ),
    attention_backend: str = typer.Option(
        _ENGINE_DEFAULTS.attention_backend, help=f"One of {', '.join(ATTENTION_BACKENDS)}."
    ),
    enable_mixed_chunk: bool = typer.Option(
        _ENGINE_DEFAULTS.enable_mixed_chunk,
        "--enable-mixed-chunk/--disable-mixed-chunk",
        help="Run prefill chunks and decodes in one forward.",
    ),
    disable_cuda_graph: bool = DISABLE_CUDA_GRAPH,
    cuda_graph_max_bs: int | None = CUDA_GRAPH_MAX_BS,
    speculative_algorithm: str | None = SPECULATIVE_ALGORITHM,
    speculative_num_draft_tokens: int = SPECULATIVE_NUM_DRAFT_TOKENS,
    speculative_ngram_min: int = SPECULATIVE_NGRAM_MIN,
    speculative_ngram_max: int = SPECULATIVE_NGRAM_MAX,
    speculative_draft_model: str | None = SPECULATIVE_DRAFT_MODEL,
    speculative_acceptance: str = SPECULATIVE_ACCEPTANCE,
    on_error: str = typer.Option("fail", help="fail: report bad rows and exit 2 at the end; skip: write them."),
    overwrite: bool = typer.Option(False, help="Replace an existing output file (and discard a partial output)."),
    resume: bool = typer.Option(
        False, "--resume", help="Continue an interrupted run: keep the rows OUT.partial/ holds, generate the rest."
    ),
    resume_force: bool = typer.Option(
        False, "--resume-force", help="Resume even if model, dtype, sampling defaults or dataset changed."
    ),
    flush_every: int = typer.Option(256, help="Make finished rows durable at least every N rows..."),
    flush_every_seconds: float = typer.Option(5.0, help="...and at least every S seconds."),
    progress: bool = typer.Option(True, help="Show a progress bar on stderr."),
    report_memory: bool = typer.Option(False, help="Print the peak resident memory (RSS) at the end."),
) -> None:
    """Generate a completion for every row of DATASET and write one result row per prompt to OUT."""
    from transformers.utils import logging as transformers_logging

    from batchgen.job.resume import OutputPolicy, check_output_path, resume_command
    from batchgen.job.run_job import RunJob
    from batchgen.job.summary import raise_if_failed
    from batchgen.loop.engine import check_engine_options

    # batchgen reports problems with the input itself, one line each; transformers' notes would only add noise.
    transformers_logging.set_verbosity_error()
    with user_errors(ctx):
        _check_run_options(
            on_error=on_error,
            max_running_requests=max_running_requests,
            max_prefill_tokens=max_prefill_tokens,
            chunked_prefill_size=chunked_prefill_size,
            seed=seed,
            context_length=context_length,
            mem_fraction=mem_fraction,
        )
        defaults = SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            stop=tuple(stop),
            stop_token_ids=tuple(stop_token_ids),
            ignore_eos=ignore_eos,
            skip_special_tokens=skip_special_tokens,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            repetition_penalty=repetition_penalty,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            prompt_logprobs=prompt_logprobs,
            n=n,
        )
        options = EngineOptions(
            model=model,
            dtype=dtype,
            device=device,
            context_length=context_length,
            max_total_tokens=max_total_tokens,
            mem_fraction=mem_fraction,
            chunked_prefill_size=chunked_prefill_size,
            max_prefill_tokens=max_prefill_tokens,
            max_running_requests=max_running_requests,
            attention_backend=attention_backend,
            enable_mixed_chunk=enable_mixed_chunk,
            disable_cuda_graph=disable_cuda_graph,
            cuda_graph_max_bs=cuda_graph_max_bs,
            speculative_algorithm=speculative_algorithm,
            speculative_num_draft_tokens=speculative_num_draft_tokens,
            speculative_ngram_min=speculative_ngram_min,
            speculative_ngram_max=speculative_ngram_max,
            speculative_draft_model=speculative_draft_model,
            speculative_acceptance=speculative_acceptance,
            seed=seed,
            logprobs_mode=logprobs_mode,
        )
        check_engine_options(options)  # before the output's checks: a mistyped flag is named first
        _check_sampling_defaults(defaults, None)  # what needs no model, before loading it
        policy = OutputPolicy(overwrite, resume or resume_force, resume_force, flush_every, flush_every_seconds)
        if check_output_path(dataset, out, overwrite, policy.resume):
            from batchgen.job.status import check_nothing_left

            # A finished output that lacks rows is reopened by the job, which adds them.
            if check_nothing_left(dataset, out, policy.resume_force):
                print(f"batchgen: {out} is already complete; nothing to do", file=sys.stderr)
                return
        job = RunJob(dataset, out, options, defaults, on_error, progress, policy)
        _check_sampling_defaults(defaults, job.engine.vocab_size)
        if n > job.engine.max_running_requests:
            raise BatchgenError(f"--n {n} exceeds --max-running-requests {job.engine.max_running_requests}")
        summary = job.run()
        if summary.interrupted_by:  # said first, so the summary below does not read as a finished run
            # --on-error skip writes error rows too; they are flushed with the rest.
            also = f" and {summary.errors} error rows" if on_error == "skip" and summary.errors else ""
            print(
                f"batchgen: stopped by {summary.interrupted_by}: the {summary.rows} rows finished in this run{also} "
                f"are flushed to {job.output.dir}; requests still running were dropped",
                file=sys.stderr,
            )
        print(summary.line(), file=sys.stderr)
        if report_memory:
            print(f"batchgen: peak RSS {peak_rss_mib():.0f} MiB", file=sys.stderr)
        if summary.interrupted_by:
            print(f"batchgen: to resume: {resume_command(dataset, out)}", file=sys.stderr)
            raise typer.Exit(128 + signal.Signals[summary.interrupted_by].value)
        raise_if_failed(summary, on_error)
