"""The benchmark commands print and record every field they promise (their speed is not tested)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen.bench.model_costs import forward_flops, generation_flops, layer_params
from batchgen.bench.probes import Ceilings
from batchgen.cli.app import expand_multi_value_options
from batchgen.models.config import ModelConfig
from tests.helpers.cli import run_cli, write_jsonl


def test_multi_value_options_are_expanded() -> None:
    argv = ["bench-one-batch", "--model", "m", "--batch-size", "1", "8", "32", "--input-len", "256", "--dtype", "x"]
    assert expand_multi_value_options(argv) == [
        "bench-one-batch",
        "--model",
        "m",
        "--batch-size",
        "1",
        "--batch-size",
        "8",
        "--batch-size",
        "32",
        "--input-len",
        "256",
        "--dtype",
        "x",
    ]


def _tiny_config() -> ModelConfig:
    """Hidden 8, MLP 16, 2 layers, 2 heads of 4 / 1 KV head, vocabulary 10: small enough to count by hand."""
    from transformers import LlamaConfig

    hf = LlamaConfig(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=10,
    )
    hf.architectures = ["LlamaForCausalLM"]
    return ModelConfig.from_hf(hf)


def test_flop_count_by_hand() -> None:
    config = _tiny_config()
    # per layer: q 8x8 + k,v 8x4 each + o 8x8 + MLP 3 x 8x16 = 64 + 64 + 64 + 384 = 576
    assert layer_params(config) == 2 * 576
    # 3 new tokens after a 2-token prefix: 3*2 + 3*4/2 = 12 query-key pairs; one sampled row.
    assert forward_flops(config, [3], [2], 1) == 2 * 1152 * 3 + 2 * 8 * 10 + 4 * 2 * 2 * 4 * 12


def test_generation_flops_by_hand() -> None:
    """Two prompts of 3 and 5 tokens, 2 new tokens each: a prefill of 8 tokens that samples 2 rows, then one step
    of 2 single tokens after prefixes of 3 and 5."""
    config = _tiny_config()
    # 10 tokens through 1,152 layer weights; 4 sampled rows through the 8 x 10 LM head; query-key pairs: prefill
    # 3*4/2 + 5*6/2 = 21, decode (3 + 1) + (5 + 1) = 10, each 4 * layers 2 * heads 2 * head_dim 4 FLOPs.
    assert generation_flops(config, [3, 5], 2) == 2 * 1152 * 10 + 2 * 8 * 10 * 4 + 64 * 31


def test_bench_one_batch_fields(random_models: dict[str, Path], tmp_path: Path) -> None:
    result_file = tmp_path / "r.jsonl"
    code, output = run_cli(
        [
            "bench-one-batch",
            "--model",
            str(random_models["llama"]),
            "--batch-size",
            "1",
            "--batch-size",
            "3",
            "--input-len",
            "12",
            "--output-len",
            "4",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--correctness-test",
            "--result-file",
            str(result_file),
        ]
    )
    assert code == 0, output
    assert "correctness: one chunk vs two chunks" in output and "PASS" in output
    assert "matmul" in output and "copy" in output
    cases = [json.loads(line) for line in result_file.read_text().splitlines()]
    assert [(c["batch_size"], c["input_len"], c["output_len"]) for c in cases] == [(1, 12, 4), (3, 12, 4)]
    for case in cases:
        assert len(case["first_decode_latencies"]) == 3
        for key in (
            "prefill_latency",
            "median_decode_latency",
            "total_latency",
            "decode_bandwidth_gbs",
            "prefill_tflops",
            "decode_throughput",
        ):
            assert case[key] > 0, key
        assert (
            abs(case["prefill_throughput"] - case["batch_size"] * 12 / case["prefill_latency"])
            < 1e-6 * case["prefill_throughput"]
        )
        assert (
            abs(case["decode_throughput"] - case["batch_size"] / case["median_decode_latency"])
            < 1e-6 * case["decode_throughput"]
        )
        # The ceilings the fractions divide by are in the record, as on the machine line.
        assert case["prefill_flops_fraction"] == pytest.approx(
            case["prefill_tflops"] / case["matmul_ceiling_tflops"], rel=1e-9
        )
        assert case["decode_bandwidth_fraction"] == pytest.approx(
            case["decode_bandwidth_gbs"] / case["copy_ceiling_gbs"], rel=1e-9
        )
        # Attention is part of each timed part, never all of it (the linear layers run too).
        shares = (case["prefill_attention_share"], case["decode_attention_share"])
        assert all(0 < share < 1 for share in shares), shares
        line = next(x for x in output.splitlines() if x.startswith(f"bs={case['batch_size']} "))
        assert line.count("attention ") == 2
        for share in shares:
            assert f"attention {share:.0%})" in line, line


@pytest.mark.parametrize("second_probe", [(1e18, 1e15), (2.0, 2.0)], ids=["fast", "slow-again"])
def test_a_probe_that_read_slow_is_repeated_once_rather_than_printing_over_100_percent(
    second_probe: tuple[float, float], random_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first probe reads 1 FLOP/s and 1 B/s, below any case: the first case probes again (1e18 FLOP/s and
    1e15 B/s, or 2 and 2 again), its fractions and the next case's are of that probe, and no third probe runs
    even when the second case beats the second probe too."""
    from batchgen.cli import bench_one_batch

    probes = iter([Ceilings(1.0, 1.0, torch.float32), Ceilings(*second_probe, torch.float32)])
    monkeypatch.setattr(bench_one_batch, "measure_ceilings", lambda dtype, device, prepack: next(probes))
    result_file = tmp_path / "r.jsonl"
    args = ["bench-one-batch", "--model", str(random_models["llama"]), "--batch-size", "1", "--batch-size", "2"]
    args += ["--input-len", "8"]
    args += ["--output-len", "3", "--dtype", "float32", "--device", "cpu", "--no-warmup"]
    code, output = run_cli([*args, "--result-file", str(result_file)])
    assert code == 0, output
    tflops, gbs = second_probe[0] / 1e12, second_probe[1] / 1e9
    assert output.count(f"machine: probed again, this case ran above the ceilings: float32 matmul {tflops:.3f}") == 1
    cases = [json.loads(line) for line in result_file.read_text().splitlines()]
    assert len(cases) == 2
    for case in cases:
        assert (case["matmul_ceiling_tflops"], case["copy_ceiling_gbs"]) == (tflops, gbs)
        assert case["prefill_flops_fraction"] == pytest.approx(case["prefill_tflops"] / tflops, rel=1e-9)
        assert case["decode_bandwidth_fraction"] == pytest.approx(case["decode_bandwidth_gbs"] / gbs, rel=1e-9)


def test_bench_one_batch_of_one_output_token_has_no_decode_figures(
    random_models: dict[str, Path], tmp_path: Path
) -> None:
    result_file = tmp_path / "r.jsonl"
    args = ["bench-one-batch", "--model", str(random_models["llama"]), "--batch-size", "2", "--input-len", "8"]
    args += ["--output-len", "1", "--dtype", "float32", "--device", "cpu", "--no-warmup"]
    code, output = run_cli([*args, "--result-file", str(result_file)])
    assert code == 0, output
    assert (
        "bs=2 in=8 out=1 | prefill " in output and "| decode n/a (one output token: the prefill samples it) |" in output
    )
    [case] = [json.loads(line) for line in result_file.read_text().splitlines()]
    assert case["first_decode_latencies"] == []
    for key in (
        "median_decode_latency",
        "decode_throughput",
        "decode_bandwidth_gbs",
        "decode_bandwidth_fraction",
        "decode_attention_share",
    ):
        assert case[key] is None, key
    assert 0 < case["prefill_attention_share"] < 1
    assert case["total_latency"] == case["prefill_latency"]
    assert case["total_throughput"] == pytest.approx(2 * 9 / case["total_latency"], rel=1e-9)


def test_bench_one_batch_reports_speculative_acceptance(random_models: dict[str, Path], tmp_path: Path) -> None:
    """Greedy float32 with the target drafting for itself: every draft is accepted, so each of the 3 requests
    emits its 10 decode tokens in 2 verify rounds of K + 1 = 5 (histogram 5:6, accept length 5.00), and every
    request row and KV slot is free again for the next case."""
    result_file = tmp_path / "r.jsonl"
    model = str(random_models["llama"])
    code, output = run_cli(
        [
            "bench-one-batch",
            *("--model", model, "--batch-size", "3", "--batch-size", "3", "--input-len", "12", "--output-len", "11"),
            *("--dtype", "float32", "--device", "cpu", "--result-file", str(result_file)),
            *("--speculative-algorithm", "draft", "--speculative-draft-model", model),
        ]
    )
    assert code == 0, output
    cases = [json.loads(line) for line in result_file.read_text().splitlines()]
    assert len(cases) == 2  # the second case runs on the pools the first one gave back
    for case in cases:
        assert case["accept_histogram"] == {"5": 6} and case["accept_length"] == 5.0
        assert (case["speculative_algorithm"], case["speculative_num_draft_tokens"]) == ("draft", 4)
        assert len(case["first_decode_latencies"]) == 2  # two verify rounds
        assert (
            abs(case["decode_throughput"] - 3 * 10 / (case["total_latency"] - case["prefill_latency"]))
            < 1e-6 * case["decode_throughput"]
        )
    assert output.count("accept length 5.00 (5:6)") == 2


def test_bench_with_hf_baseline_fields(random_models: dict[str, Path], tmp_path: Path) -> None:
    result_file = tmp_path / "r.jsonl"
    code, output = run_cli(
        [
            "bench",
            "--model",
            str(random_models["qwen2"]),
            "--num-prompts",
            "5",
            "--input-len-range",
            "4:20",
            "--output-len",
            "6",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--baseline",
            "hf",
            "--baseline",
            "hf-cb",
            "--hf-batch-size",
            "2",
            "--report-memory",
            "--deterministic",
            "--result-file",
            str(result_file),
        ]
    )
    assert code == 0, output
    assert "batchgen / hf generate =" in output and "batchgen / hf generate_batch =" in output
    assert "in float32 on cpu, --deterministic\n" in output  # the mode is said, as the default varies by CPU
    for system in ("batchgen", "hf generate", "hf generate_batch"):
        assert f"peak RSS of the process after {system}: " in output
    # transformers' progress bars and notes stay out of the benchmark's lines.
    assert "Loading weights" not in output and "ContinuousBatchingLogger" not in output
    rows = [json.loads(line) for line in result_file.read_text().splitlines()]
    assert [r["system"] for r in rows] == ["batchgen", "hf generate", "hf generate_batch"]
    for row in rows:
        assert row["requests"] == 5 and row["output_tokens"] == 30 and row["dtype"] == "float32"
        assert "attention_share" not in row  # timed with --roofline only
        assert row["input_tokens"] == rows[0]["input_tokens"]
        seconds = row["seconds"]
        assert row["output_throughput"] == pytest.approx(30 / seconds, rel=1e-9)
        assert row["request_throughput"] == pytest.approx(5 / seconds, rel=1e-9)
        assert row["input_throughput"] == pytest.approx(row["input_tokens"] / seconds, rel=1e-9)
        assert row["total_throughput"] == pytest.approx((row["input_tokens"] + 30) / seconds, rel=1e-9)
    assert rows[0]["deterministic"] is True and "deterministic" not in rows[1]
    for row in rows[1:]:
        ratio = rows[0]["output_throughput"] / row["output_throughput"]
        assert row["batchgen_ratio"] == pytest.approx(ratio, rel=1e-9)
        assert f"batchgen / {row['system']} = {ratio:.2f}x" in output


def test_a_failing_baseline_is_a_one_line_error_after_the_results(
    random_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' generate_batch logs its own errors and returns what it has (on CUDA with transformers 5.17
    once: nothing); bench then says so in one line, exits 2 and keeps the other systems' result lines."""
    from batchgen.bench.offline import ThroughputResult
    from batchgen.cli import bench as commands

    def broken(model: object, workload: Any, device: object) -> ThroughputResult:
        return ThroughputResult("hf generate_batch", 4, workload.input_tokens, 0, 0.4)

    monkeypatch.setattr(commands, "run_hf_generate_batch", broken)
    result_file = tmp_path / "r.jsonl"
    args = ["bench", "--model", str(random_models["llama"]), "--num-prompts", "4", "--input-len-range", "4:9"]
    args += ["--output-len", "3", "--dtype", "float32", "--device", "cpu", "--baseline", "hf-cb", "--baseline", "hf"]
    code, output = run_cli([*args, "--result-file", str(result_file)])
    assert code == 2, output
    assert "hf generate_batch: failed, 0 of 12 new tokens" in output and "Traceback" not in output
    assert output.strip().splitlines()[-1] == (
        "batchgen: error: baseline failed: hf generate_batch made 0 of 12 new tokens (the other systems' results stand)"
    )
    rows = [json.loads(line) for line in result_file.read_text().splitlines()]
    assert [r["system"] for r in rows] == ["batchgen", "hf generate"]


def test_bench_speculative_result_lines_and_plain_baseline(random_models: dict[str, Path], tmp_path: Path) -> None:
    """``--speculative-algorithm ngram --baseline plain``: batchgen's result line carries the settings and the
    acceptance (accept length = the histogram's mean, computed here), the plain line none; ``--baseline plain``
    without speculation is a one-line error."""
    model = str(random_models["llama"])
    workload = ("--num-prompts", "6", "--input-len-range", "16:40", "--output-len", "12", "--repetitive")
    cpu = ("--dtype", "float32", "--device", "cpu")
    result_file = tmp_path / "r.jsonl"
    code, output = run_cli(
        ["bench", "--model", model, *workload, *cpu, "--speculative-algorithm", "ngram", "--baseline", "plain"]
        + ["--baseline", "plain", "--result-file", str(result_file)]  # asked for twice, run once
    )
    assert code == 0, output
    batchgen, plain = [json.loads(line) for line in result_file.read_text().splitlines()]
    assert (batchgen["system"], plain["system"]) == ("batchgen", "plain")
    histogram = {int(k): v for k, v in batchgen["accept_histogram"].items()}
    assert sum(histogram.values()) > 0 and batchgen["speculative_algorithm"] == "ngram"
    assert batchgen["accept_length"] == pytest.approx(
        sum(k * v for k, v in histogram.items()) / sum(histogram.values())
    )
    assert f"accept length {batchgen['accept_length']:.2f}" in output
    assert "accept_length" not in plain and "speculative_algorithm" not in plain
    code, output = run_cli(["bench", "--model", model, *workload, *cpu, "--baseline", "plain"])
    assert code == 2 and "--baseline plain compares speculative decoding with plain decoding" in output


def test_bench_rejects_bad_range(random_models: dict[str, Path]) -> None:
    code, output = run_cli(["bench", "--model", str(random_models["llama"]), "--input-len-range", "9:3"])
    assert code == 2 and "--input-len-range must satisfy 1 <= low <= high, got '9:3'" in output


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
        (["--output-len", "-1"], "--output-len must be >= 1, got -1"),
        (["--baseline", "hf", "--hf-batch-size", "0"], "--hf-batch-size must be >= 1, got 0"),
        (["--max-running-requests", "0"], "--max-running-requests must be >= 1, got 0"),
        (["--chunked-prefill-size", "-1"], "--chunked-prefill-size must be >= 0, got -1"),
        (["--result-file", "/nonexistent-dir/r.jsonl"], "--result-file /nonexistent-dir/r.jsonl: cannot write"),
        # A KV pool of 10 tokens caps the context at 10: the prompts could never be scheduled (this hung before).
        (["--max-total-tokens", "10"], "--input-len-range up to 16 plus --output-len 4 exceeds the context length"),
    ],
    ids=["num-prompts", "output-len", "hf-batch-size", "max-running", "chunk", "result-file", "context"],
)
def test_bad_bench_values_are_one_line_errors(
    extra: list[str], message: str, random_models: dict[str, Path], tmp_path: Path
) -> None:
    args = ["bench", "--model", str(random_models["llama"]), "--num-prompts", "2", "--input-len-range", "8:16"]
    code, output = run_cli([*args, "--output-len", "4", "--dtype", "float32", "--device", "cpu", *extra])
    assert code == 2, output
    assert message in output and "Traceback" not in output
    assert "req/s" not in output  # refused before any work


def test_bench_takes_a_run_configs_engine_options_and_names_what_it_leaves_aside(
    random_models: dict[str, Path], tmp_path: Path
) -> None:
    """One --config file serves a job and its benchmark (found by a helper: bench had no --config): the options bench
    has apply, flags override them, and a run's other keys (its sampling defaults, its dataset, its seed, which is not
    bench's --seed of the workload) are named in one note and left aside."""
    config = tmp_path / "job.yaml"
    lines = [f"model: {random_models['llama']}", "dtype: float32", "device: cpu", "max-total-tokens: 10"]
    lines += ["report-memory: true", "max-new-tokens: 64", "seed: 3", "dataset: prompts.jsonl"]
    config.write_text("\n".join(lines) + "\n")
    args = ["bench", "--config", str(config), "--num-prompts", "2", "--input-len-range", "8:16", "--output-len", "4"]
    code, output = run_cli(args)
    assert code == 2 and "--input-len-range up to 16 plus --output-len 4 exceeds the context length" in output
    note = f"batchgen: note: {config}: max-new-tokens, seed, dataset: not options of bench, left aside"
    assert f"{note}; its own --seed means another thing; its own --dataset means another thing" in output.splitlines()
    result_file = tmp_path / "r.jsonl"
    code, output = run_cli([*args, "--max-total-tokens", "200", "--result-file", str(result_file)])
    assert code == 0, output
    (record,) = [json.loads(line) for line in result_file.read_text().splitlines()]
    assert (record["model"], record["dtype"], record["requests"]) == (str(random_models["llama"]), "float32", 2)
    assert "peak RSS" in output  # bench's --report-memory, which run's key means too
    code, output = run_cli(["bench-one-batch", "--config", str(config), "--batch-size", "1", "--input-len", "8"])
    assert code == 0, output
    assert f"batchgen: note: {config}: max-total-tokens, report-memory, max-new-tokens, seed, dataset: not " in output


def test_bench_one_batch_checks_its_result_file_first(random_models: dict[str, Path]) -> None:
    args = ["bench-one-batch", "--model", str(random_models["llama"]), "--batch-size", "1", "--input-len", "8"]
    code, output = run_cli([*args, "--output-len", "2", "--device", "cpu", "--result-file", "/nonexistent-dir/r.jsonl"])
    assert code == 2 and "--result-file /nonexistent-dir/r.jsonl: cannot write" in output
    assert "machine:" not in output


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (["--batch-size", "2", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--input-len", "-5"], "--input-len must be >= 1, got -5"),
        (["--output-len", "0"], "--output-len must be >= 1, got 0"),
        (["--input-len", "100000"], "--input-len 100000 plus --output-len 2 needs 100002 positions; the model holds"),
    ],
    ids=["batch-size", "input-len", "output-len", "context"],
)
def test_bad_bench_one_batch_sizes_are_one_line_errors(
    sizes: list[str], message: str, random_models: dict[str, Path]
) -> None:
    args = ["bench-one-batch", "--model", str(random_models["llama"]), "--device", "cpu", "--output-len", "2"]
    code, output = run_cli([*args, *sizes])
    assert code == 2, output
    assert message in output and "Traceback" not in output and "machine:" not in output


def test_bench_one_batch_fills_the_models_positions_as_run_does(random_models: dict[str, Path]) -> None:
    """Input + output = max_position_embeddings (256) is a context ``run`` accepts (the last output token is never
    fed back), so bench-one-batch takes it too; one more is refused."""
    args = ["bench-one-batch", "--model", str(random_models["llama"]), "--device", "cpu", "--dtype", "float32"]
    code, output = run_cli([*args, "--input-len", "250", "--output-len", "6", "--no-warmup"])
    assert code == 0, output
    assert "bs=1 in=250 out=6" in output
    code, output = run_cli([*args, "--input-len", "251", "--output-len", "6", "--no-warmup"])
    assert code == 2 and "needs 257 positions; the model holds 256" in output


def test_bench_one_batch_stops_at_a_sliding_window_as_run_does(tmp_path: Path) -> None:
    """Found by a review: a model whose window (80) is below its positions (256) was let through to the engine, whose
    refusal named a --context-length the command was never given."""
    from tests.helpers.models import build_random_model

    model = build_random_model(tmp_path / "m", "mistral", sliding_window=80)
    args = ["bench-one-batch", "--model", str(model), "--device", "cpu", "--dtype", "float32", "--no-warmup"]
    assert run_cli([*args, "--input-len", "70", "--output-len", "6"])[0] == 0
    code, output = run_cli([*args, "--input-len", "100", "--output-len", "6"])
    assert code == 2 and "needs 106 positions; the model holds 80 (the model attends over a sliding window" in output


def test_bench_dataset_says_which_rows_it_skipped(random_models: dict[str, Path], tmp_path: Path) -> None:
    rows = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": "oops"}, {"prompt_token_ids": [4, 5]}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    args = ["bench", "--model", str(random_models["llama"]), "--dataset", str(dataset), "--output-len", "2"]
    code, output = run_cli([*args, "--dtype", "float32", "--device", "cpu"])
    assert code == 0, output
    assert "skipped 1 rows the benchmark cannot use; the first:" in output and "d.jsonl:2" in output
    assert "workload: 2 prompts" in output
    assert f"{dataset} has 2 usable rows, fewer than --num-prompts 64; the benchmark runs those" in output
    assert "--input-len-range" not in output  # left at its default: nothing to say
    code, output = run_cli([*args, "--dtype", "float32", "--device", "cpu", "--input-len-range", "8:16"])
    assert code == 0 and f"--input-len-range is not used with --dataset: {dataset}'s prompts" in output


def test_bench_output_len_that_leaves_no_room_for_a_prompt_is_one_line(
    random_models: dict[str, Path], tmp_path: Path
) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt_token_ids": [1, 2, 3]}])
    base = ["bench", "--model", str(random_models["llama"]), "--dtype", "float32", "--device", "cpu"]
    # The tiny test models have 256 positions (conftest's max_position_embeddings).
    for extra in (["--dataset", str(dataset)], []):
        code, output = run_cli([*base, *extra, "--output-len", "256"])
        assert (code, output) == (
            2,
            "batchgen: error: --output-len 256 leaves no room for a prompt in the context length 256 (the model's, "
            "or what --max-total-tokens leaves)\n",
        ), output


@pytest.mark.parametrize("probed_tflops", [(1.0, 2.0), (2.0, 1.0)], ids=["faster-after", "faster-before"])
def test_bench_roofline_line_and_fields(
    probed_tflops: tuple[float, float], random_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The matmul rate is probed before and after batchgen's run (here 1 and 2 TFLOP/s, in either order) and the
    roofline is at the faster: 2 TFLOP/s."""
    from batchgen.bench import offline
    from batchgen.cli import bench as commands

    probes = iter([Ceilings(t * 1e12, 1e10, torch.float32) for t in probed_tflops])
    for module in (commands, offline):
        monkeypatch.setattr(module, "measure_ceilings", lambda dtype, device, prepack: next(probes))
    result_file = tmp_path / "r.jsonl"
    args = ["bench", "--model", str(random_models["llama"]), "--num-prompts", "3", "--input-len-range", "4:9"]
    args += ["--output-len", "3", "--dtype", "float32", "--device", "cpu", "--roofline"]
    code, output = run_cli([*args, "--result-file", str(result_file)])
    assert code == 0, output
    line = next(x for x in output.splitlines() if x.strip().startswith("roofline:"))
    # A tiny model's figures keep their significant digits (0.000 TFLOP and 0.00 s said nothing).
    number = r"([0-9.]+(?:e-[0-9]+)?)"
    pattern = number + r" TFLOP at the measured 2.000 TFLOP/s matmul rate \(the faster probe, before or after\): "
    match = re.search(pattern + number + r" s, at most ([0-9.]+) output tok/s", line)
    assert match and "batchgen at " in line, line
    row = json.loads(result_file.read_text())
    assert float(match.group(1)) * 1e12 / 2e12 == pytest.approx(row["roofline_seconds"], rel=1e-3)
    assert float(match.group(2)) == pytest.approx(row["roofline_seconds"], rel=5e-3)
    assert 9 / row["roofline_seconds"] == pytest.approx(float(match.group(3)), rel=1e-3)  # 3 prompts x 3 tokens
    assert abs(row["roofline_fraction"] - row["roofline_seconds"] / row["seconds"]) < 1e-9
    assert 0 < row["attention_share"] < 1
    assert line.endswith(f"; attention {row['attention_share']:.0%}"), line


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_matmul_probe_runs_the_models_linear_path(dtype: torch.dtype) -> None:
    """The probe computes x W^T (against float64, from the same random draws) through the path the model's layers
    take here, and names the dtype that path computes in: a bfloat16 run's own where oneDNN has bfloat16 kernels,
    else float32."""
    from batchgen.bench.probes import model_linear
    from batchgen.models.packed_linear import cpu_gemm_dtype

    torch.manual_seed(5)
    matmul, gemm_dtype = model_linear(dtype, torch.device("cpu"), 64)
    torch.manual_seed(5)
    weight, x = torch.randn(64, 64).to(dtype), torch.randn(64, 64).to(dtype)
    assert gemm_dtype == (cpu_gemm_dtype(dtype, torch.device("cpu")) or dtype)
    out = matmul()
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), x.double() @ weight.double().T, rtol=2**-7, atol=1e-2)
    line = Ceilings(matmul_flops=1.5e11, copy_bandwidth=3e10, gemm_dtype=gemm_dtype).line(dtype)
    name = str(dtype).removeprefix("torch.")
    if gemm_dtype == dtype:
        assert line == f"{name} matmul 0.150 TFLOP/s, copy 30.0 GB/s"
    else:
        assert line == f"{name} matmul 0.150 TFLOP/s (as float32 GEMMs, as the model's layers run here), copy 30.0 GB/s"


@pytest.mark.parametrize("written_before", [False, True])
def test_ctrl_c_in_a_benchmark_is_one_line_and_keeps_the_result_file_only_with_results(
    written_before: bool, random_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchgen.bench import one_batch

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(one_batch.OneBatchRunner, "run_case", interrupted)
    result_file = tmp_path / "r.jsonl"
    if written_before:
        result_file.write_text('{"an earlier case": 1}\n')
    args = ["bench-one-batch", "--model", str(random_models["llama"]), "--input-len", "8", "--output-len", "2"]
    code, output = run_cli([*args, "--dtype", "float32", "--device", "cpu", "--result-file", str(result_file)])
    assert code == 130  # 128 + SIGINT, as a stopped `batchgen run`
    kept = f"; the results written so far are in {result_file}" if written_before else ""
    assert output.splitlines()[-1] == f"batchgen: interrupted{kept}"
    assert result_file.exists() == written_before  # an empty file of this run's own is not left behind
