"""The ``bench-one-batch`` command: one static batch straight through the model, per case."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import typer

from batchgen.bench.one_batch import OneBatchRunner
from batchgen.bench.probes import measure_ceilings
from batchgen.cli.bench import ONE_BATCH_ENGINE_OPTIONS, benchmark_interrupts, check_writable
from batchgen.cli.config import load_config
from batchgen.cli.options import with_options
from batchgen.cli.user_errors import user_errors
from batchgen.errors import BatchgenError
from batchgen.job.summary import speculative_record
from batchgen.loop.engine import Engine, dtype_name
from batchgen.loop.options import EngineOptions
from batchgen.models.config import context_limit
from batchgen.models.source import ModelSource
from batchgen.speculative import make_drafter


@with_options(only=ONE_BATCH_ENGINE_OPTIONS, required=("model",))
def bench_one_batch(
    options: EngineOptions,
    batch_size: list[int] = typer.Option([1], help="Batch sizes (several values allowed)."),
    config: Path | None = typer.Option(
        None,
        help="A run's YAML file of option defaults: its engine options apply (flags override), the rest is left aside.",
        is_eager=True,
        callback=load_config,
    ),
    input_len: list[int] = typer.Option([256], help="Prompt lengths in tokens (several values allowed)."),
    output_len: list[int] = typer.Option([32], help="Generated tokens per request (several values allowed)."),
    prefix_len: int = typer.Option(
        0,
        help="Tokens of each prompt already in the KV cache, as a prefix cache hit leaves them: prefilled untimed "
        "before each case, so the timed prefill computes --input-len tokens over them (its throughput and FLOP/s "
        "count those only).",
    ),
    result_file: Path | None = typer.Option(None, help="Append one JSON line per case to this file."),
    correctness_test: bool = typer.Option(
        False, help="Check that a prefill split in two chunks gives the same logits."
    ),
    warmup: bool = typer.Option(True, help="Run one small case first, untimed."),
) -> None:
    """One static batch straight through ForwardBatch → ModelRunner.forward → sample, for every combination of
    batch size, input and output length (after a prefix of --prefix-len tokens already in the KV cache): prefill
    and decode latency, throughput, bandwidth and FLOP/s (with speculative decoding, the decode steps are the
    engine's verify rounds, and the acceptance is reported)."""
    with user_errors(), benchmark_interrupts(result_file):
        options.validate()
        for flag, values in (("--batch-size", batch_size), ("--input-len", input_len), ("--output-len", output_len)):
            if min(values) < 1:
                raise BatchgenError(f"{flag} must be >= 1, got {min(values)}")
        if prefix_len < 0:
            raise BatchgenError(f"--prefix-len must be >= 0, got {prefix_len}")
        check_writable(result_file)
        # Prompt + output tokens, as `run`'s context length counts them (the last token is never fed back).
        longest = prefix_len + max(input_len) + max(output_len)
        max_positions, why = context_limit(ModelSource.open(options.model).hf_config, None)  # a sliding window too
        if longest > max_positions:
            prefix = f"--prefix-len {prefix_len} plus " if prefix_len else ""
            raise BatchgenError(
                f"{prefix}--input-len {max(input_len)} plus --output-len {max(output_len)} needs {longest} positions; "
                f"the model holds {max_positions}" + (f" ({why})" if why else "")
            )
        engine = Engine(
            replace(
                options,
                context_length=longest,
                max_running_requests=max(batch_size),
                max_total_tokens=max(batch_size) * longest,
                chunked_prefill_size=0,
                generation_config="none",  # its rows are greedy, as its own flags make them
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
        ceilings = measure_ceilings(engine.dtype, engine.device, engine.switches.cpu_prepack)
        mode = ", --deterministic" if engine.deterministic else ""
        print(f"machine: {engine.device}, {ceilings.line(engine.dtype)}{mode}")
        if warmup:
            runner.run_case(min(batch_size), min(16, min(input_len)), 2, ceilings, min(16, prefix_len))
        probed_again = False
        for bs in batch_size:
            for n_in in input_len:
                for n_out in output_len:
                    result = runner.run_case(bs, n_in, n_out, ceilings, prefix_len)
                    if result.above(ceilings) and not probed_again:
                        # The machine's speed moves (a shared VM's by 20 % within minutes): probe again rather
                        # than print a share of the peak above 100 %. Once: a case that beats the second probe
                        # too really beat it (a model whose weights stay in the CPU's cache beats the copy probe).
                        probed_again = True
                        ceilings = ceilings.highest(
                            measure_ceilings(engine.dtype, engine.device, engine.switches.cpu_prepack)
                        )
                        result = result.against(ceilings)
                        print(f"machine: probed again, this case ran above the ceilings: {ceilings.line(engine.dtype)}")
                    print(result.line())
                    if result_file is not None:
                        with open(result_file, "a") as f:
                            record = {"model": options.model, "dtype": dtype_name(engine.dtype), **result.as_dict()}
                            record.update(speculative_record(engine.options, result.accept_histogram or {}))
                            f.write(json.dumps(record) + "\n")
