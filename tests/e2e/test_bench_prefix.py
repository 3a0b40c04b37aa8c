"""The benchmarks' prefix-cache side: bench's shared-prefix workload and cached share, bench-one-batch's
``--prefix-len`` (their speed is not tested)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from batchgen.bench.model_costs import forward_flops
from tests.helpers.cli import run_cli, write_jsonl

CPU = ("--dtype", "float32", "--device", "cpu")


@pytest.mark.parametrize("cache", ["--prefix-cache", "--no-prefix-cache"])
def test_bench_shared_prefix_workload_line_and_cached_share(
    cache: str, random_models: dict[str, Path], tmp_path: Path
) -> None:
    """5 prompts in 2 groups of a 12-token prefix, questions of 3-6 tokens: the workload line says so; batchgen's
    line and record carry the cached share with the cache on (``null`` and no words with it off), the HF
    baseline's record ``null``."""
    result_file = tmp_path / "r.jsonl"
    args = ["bench", "--model", str(random_models["llama"]), "--num-prompts", "5", "--input-len-range", "3:6"]
    args += ["--shared-prefix-groups", "2", "--shared-prefix-len", "12", "--output-len", "2", *CPU, cache]
    code, output = run_cli([*args, "--baseline", "hf", "--result-file", str(result_file)])
    assert code == 0, output
    assert "workload: 5 prompts in 2 groups sharing a prefix of 12 tokens, " in output
    batchgen, hf = [json.loads(line) for line in result_file.read_text().splitlines()]
    assert 5 * (12 + 3) <= batchgen["input_tokens"] <= 5 * (12 + 6)
    assert batchgen["output_tokens"] == hf["output_tokens"] == 10
    assert hf["prefix_cache_share"] is None
    lines = [x for x in output.splitlines() if "req/s" in x]
    assert len(lines) == 2 and "prefix cache" not in lines[1]
    if cache == "--no-prefix-cache":
        assert batchgen["prefix_cache_share"] is None and "prefix cache" not in output
    else:
        share = batchgen["prefix_cache_share"]
        assert 0.0 <= share <= 1.0
        assert lines[0].endswith(f" s | prefix cache {share * 100:.0f} % of prompt tokens"), lines[0]


def test_the_cached_share_is_of_the_timed_run_only(random_models: dict[str, Path]) -> None:
    """The engine's counts hold earlier runs' tokens (here 1,000 cached ones put there); prompts that share no
    first token cannot hit the cache, so this run's share is 0, not 1000 / (1000 + 12)."""
    from batchgen.bench.offline import run_engine
    from batchgen.bench.workload import Workload
    from batchgen.loop.engine import Engine
    from batchgen.loop.options import EngineOptions

    engine = Engine(EngineOptions(model=str(random_models["llama"]), dtype="float32", device="cpu"))
    engine.stats.cached_tokens = 1000
    result = run_engine(engine, Workload([[1, 2, 3, 4], [2, 3, 4, 5], [3, 4, 5, 6]], 2))
    assert result.prefix_cache_share == 0.0 and result.output_tokens == 6


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--shared-prefix-groups", "2"], "--shared-prefix-groups and --shared-prefix-len go together"),
        (["--shared-prefix-len", "8"], "--shared-prefix-groups and --shared-prefix-len go together"),
        (["--shared-prefix-groups", "0", "--shared-prefix-len", "8"], "--shared-prefix-groups must be >= 1, got 0"),
        (["--shared-prefix-groups", "2", "--shared-prefix-len", "0"], "--shared-prefix-len must be >= 1, got 0"),
        (["--shared-prefix-groups", "2", "--shared-prefix-len", "8", "--repetitive"], "not with --repetitive"),
        (
            ["--shared-prefix-groups", "100", "--shared-prefix-len", "8"],
            "--shared-prefix-groups 100 exceeds --num-prompts 2: a group needs a prompt",
        ),
        (
            ["--shared-prefix-groups", "2", "--shared-prefix-len", "237"],
            "--shared-prefix-len 237 plus --input-len-range up to 16 plus --output-len 4 exceeds the context length "
            "256",
        ),
    ],
    ids=["groups-alone", "len-alone", "groups", "len", "repetitive", "more-groups-than-prompts", "context"],
)
def test_bad_shared_prefix_flags_are_one_line_errors(
    extra: list[str], message: str, random_models: dict[str, Path]
) -> None:
    args = ["bench", "--model", str(random_models["llama"]), "--num-prompts", "2", "--input-len-range", "8:16"]
    code, output = run_cli([*args, "--output-len", "4", *CPU, *extra])
    assert code == 2, output
    assert message in output and "Traceback" not in output and len(output.strip().splitlines()) == 1
    assert "req/s" not in output


def test_shared_prefix_is_not_with_a_dataset(random_models: dict[str, Path], tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt_token_ids": [1, 2, 3]}])
    args = ["bench", "--model", str(random_models["llama"]), "--dataset", str(dataset), *CPU]
    code, output = run_cli([*args, "--shared-prefix-groups", "2", "--shared-prefix-len", "8"])
    assert (code, output) == (
        2,
        "batchgen: error: --shared-prefix-groups generates its own prompts: not with --dataset\n",
    )
    # A prefix of 236 + 16 + 4 = 256 tokens fills the context exactly: accepted.
    args = ["bench", "--model", str(random_models["llama"]), "--num-prompts", "1", "--input-len-range", "16:16"]
    code, output = run_cli(
        [*args, *CPU, "--output-len", "4", "--shared-prefix-groups", "1", "--shared-prefix-len", "236"]
    )
    assert code == 0 and "workload: 1 prompts in 1 groups sharing a prefix of 236 tokens, 252 input tokens" in output


@pytest.mark.parametrize("prefix_len", [0, 16])
def test_bench_one_batch_prefix_len_counts_only_the_new_tokens(
    prefix_len: int, random_models: dict[str, Path], tmp_path: Path
) -> None:
    """2 requests of 8 new tokens over a 16-token prefix: the prefill rates are of 16 tokens, its FLOPs those of 8
    tokens per request attending to 16 earlier ones (model_costs' formula, checked by hand in test_bench)."""
    from transformers import AutoConfig

    from batchgen.models.config import ModelConfig

    model = random_models["llama"]
    result_file = tmp_path / "r.jsonl"
    args = ["bench-one-batch", "--model", str(model), "--batch-size", "2", "--input-len", "8", "--output-len", "3"]
    code, output = run_cli([*args, "--prefix-len", str(prefix_len), *CPU, "--result-file", str(result_file)])
    assert code == 0, output
    shown = f"bs=2 prefix={prefix_len} in=8" if prefix_len else "bs=2 in=8"
    assert re.search(rf"^{shown} out=3 \| prefill ", output, re.M), output
    [case] = [json.loads(line) for line in result_file.read_text().splitlines()]
    assert (case["batch_size"], case["prefix_len"], case["input_len"], case["output_len"]) == (2, prefix_len, 8, 3)
    latency = case["prefill_latency"]
    assert case["prefill_throughput"] == pytest.approx(16 / latency, rel=1e-9)
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model))
    flops = forward_flops(config, [8, 8], [prefix_len, prefix_len], 2)
    assert case["prefill_tflops"] == pytest.approx(flops / latency / 1e12, rel=1e-9)
    assert case["total_throughput"] == pytest.approx(2 * (8 + 3) / case["total_latency"], rel=1e-9)
    assert len(case["first_decode_latencies"]) == 2


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (["--prefix-len", "-1"], "--prefix-len must be >= 0, got -1"),
        (
            ["--prefix-len", "200", "--input-len", "50"],
            "--prefix-len 200 plus --input-len 50 plus --output-len 7 needs 257 positions; the model holds 256",
        ),
    ],
    ids=["negative", "context"],
)
def test_bad_prefix_len_is_a_one_line_error(sizes: list[str], message: str, random_models: dict[str, Path]) -> None:
    args = ["bench-one-batch", "--model", str(random_models["llama"]), "--device", "cpu", "--output-len", "7"]
    code, output = run_cli([*args, *sizes])
    assert code == 2, output
    assert message in output and "Traceback" not in output and "machine:" not in output


def test_prefill_over_a_prefix_gives_the_logits_of_a_whole_prefill_and_of_hf(random_models: dict[str, Path]) -> None:
    """Prompts of 24, 20 and 24 tokens: their last logits after a 16-token prefix round then the rest equal those
    of one whole prefill on the same engine, and HF float32's on the same prompts; the first tokens are HF's
    argmax."""
    from transformers import AutoModelForCausalLM

    from batchgen.bench.one_batch import OneBatchRunner
    from batchgen.loop.engine import Engine
    from batchgen.loop.options import EngineOptions

    model = random_models["llama"]
    options = EngineOptions(model=str(model), dtype="float32", device="cpu", context_length=32, max_total_tokens=200)
    runner = OneBatchRunner(Engine(options), seed=3)
    prompts: list[list[int]] = []
    results = []
    for prefix_len in (16, 0):
        reqs = runner.make_reqs(3, 24, 1)
        prompts = prompts or [r.prompt_ids[: 20 if i == 1 else 24] for i, r in enumerate(reqs)]
        for req, prompt in zip(reqs, prompts):
            req.prompt_ids = prompt
        try:
            _, logits, out = runner.prefill(reqs, prefix_len)
            results.append((logits.clone(), out.next_token_ids.tolist()))
            assert [r.kv_len for r in reqs] == [24, 20, 24]
        finally:
            runner.release(reqs)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    for logits, tokens in results:
        torch.testing.assert_close(logits.float(), expected, rtol=1e-4, atol=1e-4)
        assert tokens == expected.argmax(-1).tolist()
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
