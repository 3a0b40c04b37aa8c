"""The ``bench`` command (offline throughput), and what it shares with ``bench-one-batch``."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields, replace
from pathlib import Path

import typer

from batchgen.bench.offline import (
    load_hf_model,
    measure_roofline,
    run_engine,
    run_engine_timing_attention,
    run_hf_generate,
    run_hf_generate_batch,
)
from batchgen.bench.probes import measure_ceilings
from batchgen.bench.workload import Workload, dataset_workload, random_workload, shared_prefix_workload
from batchgen.cli.config import load_config
from batchgen.cli.options import with_options
from batchgen.cli.user_errors import user_errors
from batchgen.errors import BatchgenError
from batchgen.job.summary import peak_rss_mib, speculative_record, speculative_summary
from batchgen.loop.engine import Engine, dtype_name
from batchgen.loop.options import EngineOptions
from batchgen.speculative import make_drafter

# The engine options of bench-one-batch, which sizes the context, the KV pool and the batch itself per case;
# bench takes the batch-size options too. Not the run seed: bench's --seed seeds its random workload.
ONE_BATCH_ENGINE_OPTIONS = (
    "model",
    "dtype",
    "device",
    "attention_backend",
    "disable_cuda_graph",
    "cuda_graph_max_bs",
    "deterministic",
    *(f.name for f in fields(EngineOptions) if f.name.startswith("speculative_")),
)
BENCH_ENGINE_OPTIONS = (
    *ONE_BATCH_ENGINE_OPTIONS,
    "max_running_requests",
    "chunked_prefill_size",
    "max_prefill_tokens",
    "max_total_tokens",
    "enable_mixed_chunk",
    "prefix_cache",
)
DEFAULT_INPUT_LEN_RANGE = "32:256"


@contextmanager
def benchmark_interrupts(result_file: Path | None) -> Iterator[None]:
    """Ctrl-C ends a benchmark with one line on stderr and exit code 130 (128 + SIGINT). The lines already in
    ``--result-file`` stay; a result file this run created and never wrote to is removed."""
    existed = result_file is not None and result_file.exists()
    try:
        yield
    except KeyboardInterrupt:
        kept = ""
        if result_file is not None and result_file.exists():
            if not existed and result_file.stat().st_size == 0:
                result_file.unlink()
            else:
                kept = f"; the results written so far are in {result_file}"
        print(f"batchgen: interrupted{kept}", file=sys.stderr)
        raise typer.Exit(128 + signal.SIGINT) from None


def check_writable(result_file: Path | None) -> None:
    """Open ``--result-file`` for appending before any work, so a bad path fails first, not after the benchmark.

    Raises:
        BatchgenError: the file cannot be opened for appending.
    """
    if result_file is None:
        return
    try:
        with open(result_file, "a"):
            pass
    except OSError as e:
        raise BatchgenError(f"--result-file {result_file}: cannot write: {e.strerror or e}") from None


def _parse_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(":"))
    except ValueError:
        raise BatchgenError(f"--input-len-range must look like 32:256, got '{text}'") from None
    if not 1 <= low <= high:
        raise BatchgenError(f"--input-len-range must satisfy 1 <= low <= high, got '{text}'")
    return low, high


def _check_shared_prefix(
    groups: int | None, length: int | None, dataset: Path | None, repetitive: bool, num_prompts: int
) -> tuple[int, int] | None:
    """``(groups, prefix length)`` of a shared-prefix workload, ``None`` without one.

    Raises:
        BatchgenError: only one of the two flags, a value below 1, more groups than prompts, or with --dataset or
            --repetitive.
    """
    if groups is None and length is None:
        return None
    if groups is None or length is None:
        raise BatchgenError("--shared-prefix-groups and --shared-prefix-len go together: give both or neither")
    for flag, value in (("--shared-prefix-groups", groups), ("--shared-prefix-len", length)):
        if value < 1:
            raise BatchgenError(f"{flag} must be >= 1, got {value}")
    if groups > num_prompts:
        raise BatchgenError(
            f"--shared-prefix-groups {groups} exceeds --num-prompts {num_prompts}: a group needs a prompt"
        )
    for flag, given in (("--dataset", dataset is not None), ("--repetitive", repetitive)):
        if given:
            raise BatchgenError(f"--shared-prefix-groups generates its own prompts: not with {flag}")
    return groups, length


def _shape(workload: Workload, shared: tuple[int, int] | None) -> str:
    """``64 prompts``, or ``64 prompts in 4 groups sharing a prefix of 768 tokens``."""
    shape = f"{len(workload.prompts)} prompts"
    return shape if shared is None else f"{shape} in {shared[0]} groups sharing a prefix of {shared[1]} tokens"


@with_options(only=BENCH_ENGINE_OPTIONS, required=("model",), config_keys=("report_memory",))
def bench(
    options: EngineOptions,
    num_prompts: int = typer.Option(64, help="Prompts in the workload."),
    config: Path | None = typer.Option(
        None,
        help="A run's YAML file of option defaults: its engine options apply (flags override), the rest is left aside.",
        is_eager=True,
        callback=load_config,
    ),
    input_len_range: str = typer.Option(
        DEFAULT_INPUT_LEN_RANGE, help="Prompt lengths, uniform in LOW:HIGH tokens (not with --dataset)."
    ),
    output_len: int = typer.Option(64, help="New tokens per prompt (EOS ignored)."),
    dataset: Path | None = typer.Option(None, help="Take prompts from this JSONL/Parquet dataset instead."),
    baseline: list[str] = typer.Option(
        [], help="Also run hf (generate), hf-cb (generate_batch) and/or plain (the engine without speculation)."
    ),
    repetitive: bool = typer.Option(False, help="Random prompts that repeat a short motif of their own."),
    shared_prefix_groups: int | None = typer.Option(
        None,
        help="Prompts that share prefixes: N random prefixes, prompt i = prefix i % N + a random question of "
        "--input-len-range tokens (with --shared-prefix-len).",
    ),
    shared_prefix_len: int | None = typer.Option(
        None, help="Tokens of each shared prefix (with --shared-prefix-groups)."
    ),
    hf_batch_size: int = typer.Option(32, help="Static batch size of the hf baseline."),
    seed: int = typer.Option(0, help="Seed of the random workload."),
    report_memory: bool = typer.Option(False, help="Print the peak resident memory after each system."),
    roofline: bool = typer.Option(
        False,
        help="Also probe the matmul rate and print batchgen's share of the workload's compute roofline, and the "
        "share of batchgen's wall time spent in attention (the attention backend's calls, timed; n/a where CUDA "
        "graphs replay rounds).",
    ),
    result_file: Path | None = typer.Option(None, help="Append one JSON line per system to this file."),
) -> None:
    """Offline throughput: the whole workload through the engine, then (with --baseline) through HF
    transformers in the same process, and the ratio batchgen / baseline."""
    with user_errors(), benchmark_interrupts(result_file):
        baseline = list(dict.fromkeys(baseline))  # each system once, in the order first asked for
        unknown = set(baseline) - {"hf", "hf-cb", "plain"}
        if unknown:
            raise BatchgenError(f"--baseline must be hf, hf-cb or plain, got {', '.join(sorted(unknown))}")
        if "plain" in baseline and options.speculative_algorithm is None:
            raise BatchgenError(
                "--baseline plain compares speculative decoding with plain decoding: it needs --speculative-algorithm"
            )
        low, high = _parse_range(input_len_range)
        shared = _check_shared_prefix(shared_prefix_groups, shared_prefix_len, dataset, repetitive, num_prompts)
        for flag, value in (("--num-prompts", num_prompts), ("--output-len", output_len)):
            if value < 1:
                raise BatchgenError(f"{flag} must be >= 1, got {value}")
        if {"hf", "hf-cb"} & set(baseline) and hf_batch_size < 1:
            raise BatchgenError(f"--hf-batch-size must be >= 1, got {hf_batch_size}")
        options.validate()
        check_writable(result_file)
        # The workload's rows sample as bench's flags say (greedy), whatever the model's generation_config.json.
        engine = Engine(replace(options, generation_config="none"), make_drafter)
        if output_len >= engine.context_len:
            raise BatchgenError(
                f"--output-len {output_len} leaves no room for a prompt in the context length {engine.context_len} "
                "(the model's, or what --max-total-tokens leaves)"
            )
        if dataset is not None:
            if input_len_range != DEFAULT_INPUT_LEN_RANGE:
                print(f"batchgen: --input-len-range is not used with --dataset: {dataset}'s prompts", file=sys.stderr)
            workload = dataset_workload(
                dataset, engine.tokenizer, engine.vocab_size, engine.context_len, num_prompts, output_len
            )
        else:
            prefix_len = 0 if shared is None else shared[1]
            if prefix_len + high + output_len > engine.context_len:
                named = f"--shared-prefix-len {prefix_len} plus " if prefix_len else ""
                raise BatchgenError(
                    f"{named}--input-len-range up to {high} plus --output-len {output_len} exceeds the context length "
                    f"{engine.context_len} (the model's, or what --max-total-tokens leaves)"
                )
            if shared is None:
                workload = random_workload(num_prompts, low, high, output_len, engine.vocab_size, seed, repetitive)
            else:
                workload = shared_prefix_workload(num_prompts, *shared, low, high, output_len, engine.vocab_size, seed)
        print(
            f"workload: {_shape(workload, shared)}, {workload.input_tokens} input tokens, {output_len} new tokens "
            f"each, {options.model} in {dtype_name(engine.dtype)} on {engine.device}"
            f"{', --deterministic' if engine.deterministic else ''}",
            file=sys.stderr,
        )
        probe_before = measure_ceilings(engine.dtype, engine.device, engine.switches.cpu_prepack) if roofline else None
        # Attention is timed only for the roofline: the timer synchronizes a GPU around every attention call.
        batchgen, attention_share = (
            run_engine_timing_attention(engine, workload) if roofline else (run_engine(engine, workload), None)
        )
        results = [batchgen]
        histogram = dict(engine.scheduler.accept_histogram)
        print(results[0].line() + speculative_summary(histogram))
        bound = measure_roofline(engine, workload, probe_before, attention_share) if roofline else None
        if bound is not None:
            print(bound.line(results[0]))
        if report_memory:
            print(f"peak RSS of the process after batchgen: {peak_rss_mib():.0f} MiB")
        expected_tokens = len(workload.prompts) * output_len
        failed: list[str] = []
        if baseline:
            hf_model = load_hf_model(engine) if {"hf", "hf-cb"} & set(baseline) else None
            for name in baseline:
                if name == "plain":
                    # The same engine and weights with the drafter switched off: speculation's own speedup.
                    engine.scheduler.drafter = None
                    engine.kv_cache.drop_cached()  # as cold as batchgen's own run found it
                    result = replace(run_engine(engine, workload), system="plain")
                elif name == "hf":
                    result = run_hf_generate(hf_model, workload, hf_batch_size, engine.device)
                else:
                    result = run_hf_generate_batch(hf_model, workload, engine.device)
                if result.output_tokens != expected_tokens:
                    # A baseline that errs inside (transformers' generate_batch logs and returns what it has).
                    made = f"{result.output_tokens} of {expected_tokens} new tokens"
                    failed.append(f"{result.system} made {made}")
                    print(f"{result.system:>16}: failed, {made} (its own log above says why)")
                    continue
                results.append(result)
                print(result.line())
                ratio = results[0].output_throughput / result.output_throughput
                print(f"{'ratio':>16}: batchgen / {result.system} = {ratio:.2f}x (output tok/s)")
                if report_memory:
                    # The process's peak so far: a baseline's own use shows only where it rose above the earlier peak.
                    print(
                        f"peak RSS of the process after {result.system}: {peak_rss_mib():.0f} MiB (all systems so far)"
                    )
        if result_file is not None:
            with open(result_file, "a") as f:
                for result in results:
                    record = {"model": options.model, "dtype": dtype_name(engine.dtype), **result.as_dict()}
                    if result is results[0]:  # batchgen itself; the baselines ran without speculation
                        record.update(speculative_record(engine.options, histogram), deterministic=engine.deterministic)
                    else:
                        record["batchgen_ratio"] = results[0].output_throughput / result.output_throughput
                    if bound is not None:
                        record.update(roofline_seconds=bound.seconds, roofline_fraction=bound.fraction(result))
                        if result is results[0]:
                            record["attention_share"] = bound.attention_share
                    f.write(json.dumps(record) + "\n")
        if failed:
            raise BatchgenError(f"baseline failed: {'; '.join(failed)} (the other systems' results stand)")
