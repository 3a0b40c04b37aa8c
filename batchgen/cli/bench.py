"""The ``bench-one-batch`` and ``bench`` commands (registered on the CLI app in ``batchgen.cli.app``)."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import typer

from batchgen.bench.offline import (
    load_hf_model,
    measure_roofline,
    run_engine,
    run_hf_generate,
    run_hf_generate_batch,
)
from batchgen.bench.one_batch import OneBatchRunner
from batchgen.bench.probes import measure_ceilings
from batchgen.bench.workload import dataset_workload, random_workload
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
from batchgen.errors import BatchgenError
from batchgen.job.summary import peak_rss_mib, speculative_record, speculative_summary
from batchgen.loop.engine import Engine, dtype_name
from batchgen.loop.options import EngineOptions
from batchgen.models.source import ModelSource
from batchgen.speculative import make_drafter

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


def bench_one_batch(
    model: str = typer.Option(..., help="Model directory, .gguf, built-in name, hub id or random:PRESET."),
    batch_size: list[int] = typer.Option([1], help="Batch sizes (several values allowed)."),
    input_len: list[int] = typer.Option([256], help="Prompt lengths in tokens (several values allowed)."),
    output_len: list[int] = typer.Option([32], help="Generated tokens per request (several values allowed)."),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 or float16."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    attention_backend: str = typer.Option("auto", help="Attention backend."),
    disable_cuda_graph: bool = DISABLE_CUDA_GRAPH,
    cuda_graph_max_bs: int | None = CUDA_GRAPH_MAX_BS,
    speculative_algorithm: str | None = SPECULATIVE_ALGORITHM,
    speculative_num_draft_tokens: int = SPECULATIVE_NUM_DRAFT_TOKENS,
    speculative_ngram_min: int = SPECULATIVE_NGRAM_MIN,
    speculative_ngram_max: int = SPECULATIVE_NGRAM_MAX,
    speculative_draft_model: str | None = SPECULATIVE_DRAFT_MODEL,
    speculative_acceptance: str = SPECULATIVE_ACCEPTANCE,
    result_file: Path | None = typer.Option(None, help="Append one JSON line per case to this file."),
    correctness_test: bool = typer.Option(
        False, help="Check that a prefill split in two chunks gives the same logits."
    ),
    warmup: bool = typer.Option(True, help="Run one small case first, untimed."),
) -> None:
    """One static batch straight through ForwardBatch → ModelRunner.forward → sample, for every combination of
    batch size, input and output length: prefill and decode latency, throughput, bandwidth and FLOP/s (with
    speculative decoding, the decode steps are the engine's verify rounds, and the acceptance is reported)."""
    with user_errors(), benchmark_interrupts(result_file):
        for flag, values in (("--batch-size", batch_size), ("--input-len", input_len), ("--output-len", output_len)):
            if min(values) < 1:
                raise BatchgenError(f"{flag} must be >= 1, got {min(values)}")
        check_writable(result_file)
        # Prompt + output tokens, as `run`'s context length counts them (the last token is never fed back).
        longest = max(input_len) + max(output_len)
        max_positions = int(ModelSource.open(model).hf_config.max_position_embeddings)
        if longest > max_positions:
            raise BatchgenError(
                f"--input-len {max(input_len)} plus --output-len {max(output_len)} needs {longest} positions; "
                f"the model has {max_positions}"
            )
        engine = Engine(
            EngineOptions(
                model=model,
                dtype=dtype,
                device=device,
                context_length=longest,
                attention_backend=attention_backend,
                disable_cuda_graph=disable_cuda_graph,
                cuda_graph_max_bs=cuda_graph_max_bs,
                max_running_requests=max(batch_size),
                max_total_tokens=max(batch_size) * longest,
                chunked_prefill_size=0,
                speculative_algorithm=speculative_algorithm,
                speculative_num_draft_tokens=speculative_num_draft_tokens,
                speculative_ngram_min=speculative_ngram_min,
                speculative_ngram_max=speculative_ngram_max,
                speculative_draft_model=speculative_draft_model,
                speculative_acceptance=speculative_acceptance,
            ),
            make_drafter,
        )
        runner = OneBatchRunner(engine)
        if correctness_test:
            diff = runner.correctness_test(max(input_len))
            tolerance = 1e-4 if engine.dtype.itemsize == 4 else 5e-2
            verdict = "PASS" if diff <= tolerance else "FAIL"
            print(
                f"correctness: one chunk vs two chunks, max |logit diff| = {diff:.3g} (tolerance {tolerance}) {verdict}"
            )
            if verdict == "FAIL":
                raise typer.Exit(1)
        ceilings = measure_ceilings(engine.dtype, engine.device)
        print(f"machine: {engine.device}, {ceilings.line(engine.dtype)}")
        if warmup:
            runner.run_case(min(batch_size), min(16, min(input_len)), 2, ceilings)
        probed_again = False
        for bs in batch_size:
            for n_in in input_len:
                for n_out in output_len:
                    result = runner.run_case(bs, n_in, n_out, ceilings)
                    if result.above(ceilings) and not probed_again:
                        # The machine's speed moves (a shared VM's by 20 % within minutes): probe again rather
                        # than print a share of the peak above 100 %. Once: a case that beats the second probe
                        # too really beat it (a model whose weights stay in the CPU's cache beats the copy probe).
                        probed_again = True
                        ceilings = ceilings.highest(measure_ceilings(engine.dtype, engine.device))
                        result = result.against(ceilings)
                        print(f"machine: probed again, this case ran above the ceilings: {ceilings.line(engine.dtype)}")
                    print(result.line())
                    if result_file is not None:
                        with open(result_file, "a") as f:
                            record = {"model": model, "dtype": dtype_name(engine.dtype), **result.as_dict()}
                            record.update(speculative_record(engine.options, result.accept_histogram or {}))
                            f.write(json.dumps(record) + "\n")


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


def bench(
    model: str = typer.Option(..., help="Model directory, .gguf, built-in name, hub id or random:PRESET."),
    num_prompts: int = typer.Option(64, help="Prompts in the workload."),
    input_len_range: str = typer.Option(
        DEFAULT_INPUT_LEN_RANGE, help="Prompt lengths, uniform in LOW:HIGH tokens (not with --dataset)."
    ),
    output_len: int = typer.Option(64, help="New tokens per prompt (EOS ignored)."),
    dataset: Path | None = typer.Option(None, help="Take prompts from this JSONL/Parquet dataset instead."),
    baseline: list[str] = typer.Option(
        [], help="Also run hf (generate), hf-cb (generate_batch) and/or plain (the engine without speculation)."
    ),
    repetitive: bool = typer.Option(False, help="Random prompts that repeat a short motif of their own."),
    hf_batch_size: int = typer.Option(32, help="Static batch size of the hf baseline."),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 or float16."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    seed: int = typer.Option(0, help="Seed of the random workload."),
    max_running_requests: int | None = typer.Option(None, help="Engine: requests decoding together (64 CPU, 256 GPU)."),
    chunked_prefill_size: int = typer.Option(2048, help="Engine: longest prefill chunk per round."),
    max_prefill_tokens: int = typer.Option(8192, help="Engine: prompt tokens per round."),
    max_total_tokens: int | None = typer.Option(None, help="Engine: KV pool size in tokens."),
    enable_mixed_chunk: bool = typer.Option(True, "--enable-mixed-chunk/--disable-mixed-chunk", help="Engine."),
    attention_backend: str = typer.Option("auto", help="Engine: attention backend."),
    disable_cuda_graph: bool = DISABLE_CUDA_GRAPH,
    cuda_graph_max_bs: int | None = CUDA_GRAPH_MAX_BS,
    speculative_algorithm: str | None = SPECULATIVE_ALGORITHM,
    speculative_num_draft_tokens: int = SPECULATIVE_NUM_DRAFT_TOKENS,
    speculative_ngram_min: int = SPECULATIVE_NGRAM_MIN,
    speculative_ngram_max: int = SPECULATIVE_NGRAM_MAX,
    speculative_draft_model: str | None = SPECULATIVE_DRAFT_MODEL,
    speculative_acceptance: str = SPECULATIVE_ACCEPTANCE,
    report_memory: bool = typer.Option(False, help="Print the peak resident memory after each system."),
    roofline: bool = typer.Option(
        False, help="Also probe the matmul rate and print batchgen's share of the workload's compute roofline."
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
        if "plain" in baseline and speculative_algorithm is None:
            raise BatchgenError(
                "--baseline plain compares speculative decoding with plain decoding: it needs --speculative-algorithm"
            )
        low, high = _parse_range(input_len_range)
        for flag, value in (("--num-prompts", num_prompts), ("--output-len", output_len)):
            if value < 1:
                raise BatchgenError(f"{flag} must be >= 1, got {value}")
        if {"hf", "hf-cb"} & set(baseline) and hf_batch_size < 1:
            raise BatchgenError(f"--hf-batch-size must be >= 1, got {hf_batch_size}")
        check_engine_limits(max_running_requests, max_prefill_tokens, chunked_prefill_size)
        check_writable(result_file)
        engine = Engine(
            EngineOptions(
                model=model,
                dtype=dtype,
                device=device,
                max_running_requests=max_running_requests,
                chunked_prefill_size=chunked_prefill_size,
                max_prefill_tokens=max_prefill_tokens,
                max_total_tokens=max_total_tokens,
                enable_mixed_chunk=enable_mixed_chunk,
                attention_backend=attention_backend,
                disable_cuda_graph=disable_cuda_graph,
                cuda_graph_max_bs=cuda_graph_max_bs,
                speculative_algorithm=speculative_algorithm,
                speculative_num_draft_tokens=speculative_num_draft_tokens,
                speculative_ngram_min=speculative_ngram_min,
                speculative_ngram_max=speculative_ngram_max,
                speculative_draft_model=speculative_draft_model,
                speculative_acceptance=speculative_acceptance,
            ),
            make_drafter,
        )
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
            if high + output_len > engine.context_len:
                raise BatchgenError(
                    f"--input-len-range up to {high} plus --output-len {output_len} exceeds the context length "
                    f"{engine.context_len} (the model's, or what --max-total-tokens leaves)"
                )
            workload = random_workload(num_prompts, low, high, output_len, engine.vocab_size, seed, repetitive)
        print(
            f"workload: {len(workload.prompts)} prompts, {workload.input_tokens} input tokens, {output_len} new tokens "
            f"each, {model} in {dtype_name(engine.dtype)} on {engine.device}",
            file=sys.stderr,
        )
        probe_before = measure_ceilings(engine.dtype, engine.device) if roofline else None
        results = [run_engine(engine, workload)]
        histogram = dict(engine.scheduler.accept_histogram)
        print(results[0].line() + speculative_summary(histogram))
        bound = measure_roofline(engine, workload, probe_before) if roofline else None
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
                    record = {"model": model, "dtype": dtype_name(engine.dtype), **result.as_dict()}
                    if result is results[0]:  # batchgen itself; the baselines ran without speculation
                        record.update(speculative_record(engine.options, histogram))
                    else:
                        record["batchgen_ratio"] = results[0].output_throughput / result.output_throughput
                    if bound is not None:
                        record.update(roofline_seconds=bound.seconds, roofline_fraction=bound.fraction(result))
                    f.write(json.dumps(record) + "\n")
        if failed:
            raise BatchgenError(f"baseline failed: {'; '.join(failed)} (the other systems' results stand)")
