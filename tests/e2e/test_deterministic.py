"""``--deterministic``: a row's output bytes (ids, logprobs, top logprobs, text) do not depend on the batch it ran
in, on how its prompt was chunked, on the prefix cache, on speculative decoding, on an interruption and resume,
or on being one sample of an ``n > 1`` row rather than a row of its own. The right value is the output of the same
row run another way; the same comparisons without ``--deterministic`` do differ (measured in
docs/performance.md), so byte equality is what the mode adds."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen.io.partial_output import partial_dir
from batchgen.io.writer import read_results
from batchgen.kernels.attention import deterministic_by_default
from batchgen.kernels.cpu import build_problem
from batchgen.kernels.switches import KernelSwitches
from tests.helpers.cli import generate, run_args, run_cli, write_jsonl
from tests.helpers.crash_points import AFTER_ROWS
from tests.helpers.fork_runner import Zygote
from tests.helpers.models import STORIES, build_random_model

PROMPTS = [
    "Once upon a time",
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park",
    "The sun was hot.",
    "Lily and Ben went to the park. They saw a big dog and a small cat",
]
COLUMNS = ("output_token_ids", "output_logprobs", "top_logprobs", "text", "finish_reason")
# Ways of running the job, as flags after the reference's (64 rows a round, chunks of 2048, prefix cache on).
WAYS = {
    "one row a round, no prefix cache": ["--max-running-requests", "1", "--no-prefix-cache"],
    "8 rows, chunks of 16, n-gram speculative": [
        *("--max-running-requests", "8", "--chunked-prefill-size", "16"),
        *("--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "3"),
    ],
    "3 rows, no chunking": ["--max-running-requests", "3", "--chunked-prefill-size", "0"],
}


def rows(count: int = 12, new_tokens: int = 16) -> list[dict[str, Any]]:
    """Sampled rows at temperature 1.0 (each its own seed) and greedy ones; prompts share prefixes."""
    return [
        {
            "id": f"r{i}",
            "prompt": PROMPTS[i % 4] + "." * (i // 4),
            "max_new_tokens": new_tokens,
            "temperature": 0.0 if i % 3 == 0 else 1.0,
            "seed": 100 + i,
            "logprobs": True,
            "top_logprobs": 3,
        }
        for i in range(count)
    ]


def columns(table: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Each row's compared columns, serialised exactly (floats by their repr: every bit counts)."""
    return {key: json.dumps([row[c] for c in COLUMNS]) for key, row in table.items()}


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's widths (576 hidden, 1536 MLP, 9 heads of 64 over 3 KV heads) in 2 layers: the GEMM shapes whose
    bfloat16 kernels change their reduction order with the row count, and the attention kernel's bfloat16 path."""
    shape = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3}
    return build_random_model(tmp_path_factory.mktemp("wide") / "m", "llama", **shape)


@pytest.fixture(params=["stories260k", "llama", "qwen2", "wide-llama"])
def model(request: pytest.FixtureRequest, random_models: dict[str, Path]) -> Path:
    if request.param == "stories260k":
        if not STORIES.exists():
            pytest.skip("needs ../shared/models/stories260k (the workplace's shared folder; not in a fresh clone)")
        return STORIES
    if request.param == "wide-llama":
        return Path(request.getfixturevalue("wide_llama"))
    return random_models[request.param]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_are_identical_however_the_job_runs(dtype: str, model: Path, tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "in.jsonl", rows())
    flags = ("--dtype", dtype, "--deterministic")
    reference = columns(generate(dataset, tmp_path / "ref.arrow", model, *flags, "--max-running-requests", "64"))
    assert len({json.loads(v)[0][0] for v in reference.values()}) > 1  # rows do differ from each other
    for way, extra in WAYS.items():
        got = columns(generate(dataset, tmp_path / "out.arrow", model, *flags, *extra))
        assert got == reference, way


def test_samples_of_an_n_row_equal_rows_of_their_own(random_models: dict[str, Path], tmp_path: Path) -> None:
    """Sample i of a row with seed s and n = 3 is the row with seed BLAKE2b-64("s:i") >> 1 (i > 0; the documented
    derivation), alone in its batch, and the same when the samples run as groups of 2 and 1 (fewer requests run at
    once than the row has samples)."""
    model, seed = random_models["llama"], 1234
    row = {"prompt": PROMPTS[1], "max_new_tokens": 16, "temperature": 1.0, "logprobs": True, "top_logprobs": 3}
    forked = write_jsonl(tmp_path / "n.jsonl", [{**row, "id": "r", "n": 3, "seed": seed}])
    code, output = run_cli(run_args(forked, tmp_path / "n.arrow", model, "--dtype", "bfloat16", "--deterministic"))
    assert code == 0, output
    samples = {r["sample_index"]: r for r in read_results(tmp_path / "n.arrow").to_pylist()}
    for i in range(3):
        own = (
            seed
            if i == 0
            else int.from_bytes(hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest(), "little") >> 1
        )
        single = write_jsonl(tmp_path / f"{i}.jsonl", [{**row, "id": "r", "seed": own}])
        alone = generate(single, tmp_path / f"{i}.arrow", model, "--dtype", "bfloat16", "--deterministic")
        assert columns({"r": samples[i]}) == columns(alone), i
    flags = ("--dtype", "bfloat16", "--deterministic", "--max-running-requests", "2")
    code, output = run_cli(run_args(forked, tmp_path / "groups.arrow", model, *flags))
    assert code == 0, output
    groups = {r["sample_index"]: r for r in read_results(tmp_path / "groups.arrow").to_pylist()}
    assert {i: columns({"r": r}) for i, r in groups.items()} == {i: columns({"r": r}) for i, r in samples.items()}


def _resumable_args(dataset: Path, out: Path, model: Path, *extra: str) -> list[str]:
    return [
        a for a in run_args(dataset, out, model, "--dtype", "bfloat16", "--deterministic", *extra) if a != "--overwrite"
    ]


def test_killed_and_interrupted_runs_resume_to_identical_rows(random_models: dict[str, Path], tmp_path: Path) -> None:
    """Killed (as by SIGKILL) after 5 rows, resumed with other batch sizes and stopped by SIGINT, then resumed
    to the end: every row equals the uninterrupted run's, byte for byte. A resume with --no-deterministic is
    refused: the mode is part of the job."""
    model = random_models["llama"]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows(24, 24))
    reference = columns(generate(dataset, tmp_path / "ref.arrow", model, "--dtype", "bfloat16", "--deterministic"))
    out = tmp_path / "out.arrow"
    zygote = Zygote({"OMP_NUM_THREADS": "1"})
    try:
        pid = zygote.start(
            _resumable_args(dataset, out, model, "--flush-every", "1"), {}, tmp_path / "kill.log", (AFTER_ROWS, 5)
        )
        assert zygote.wait(pid) == 137, (tmp_path / "kill.log").read_text()
    finally:
        zygote.close()
    no_mode = [
        a for a in _resumable_args(dataset, out, model, "--resume", "--no-deterministic") if a != "--deterministic"
    ]
    code, output = run_cli(no_mode)
    assert code != 0 and "deterministic true → false (--deterministic resumes" in output, output
    # One row at a time: the SIGINT follows the first new part, and the rows left must outlast the test's reaction
    # (two at a time they took under 0.3 s after it here).
    slow = ["--resume", "--max-running-requests", "1", "--flush-every", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchgen", *_resumable_args(dataset, out, model, *slow)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    before = len(list(partial_dir(out).glob("*.arrow")))
    deadline = time.monotonic() + 120
    while len(list(partial_dir(out).glob("*.arrow"))) <= before and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, stderr
    code, output = run_cli(_resumable_args(dataset, out, model, "--resume", "--max-running-requests", "5"))
    assert code == 0, output
    assert columns({r["id"]: r for r in read_results(out).to_pylist()}) == reference


def _cpu_flags() -> set[str]:
    """This CPU's instruction-set extensions as Linux lists them."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    flags = next((line.partition(":")[2].split() for line in lines if line.startswith("flags")), None)
    if flags is None:
        pytest.skip("needs /proc/cpuinfo's flags (Linux) to know this CPU's extensions")
    return set(flags)


def test_the_mode_is_the_default_on_cpus_without_amx(random_models: dict[str, Path], tmp_path: Path) -> None:
    """Neither flag: on where the batch-invariant path costs nothing measurable (docs/performance.md), which the
    CPU's extensions say (AVX-512, or AVX2 with FMA and F16C; no AMX tiles: with AVX512-BF16 brgemm runs both
    paths, without it the half-weight GEMMs do, which need their switch), for the CPU kernel's backend only; the
    output records it."""
    if build_problem() is not None:
        pytest.skip(f"needs batchgen's CPU kernels ({build_problem()})")
    flags = _cpu_flags()
    expected = ("avx512f" in flags or {"avx2", "fma", "f16c"} <= flags) and "amx_tile" not in flags
    cpu, switches = torch.device("cpu"), KernelSwitches()
    assert deterministic_by_default("auto", cpu, switches) is expected
    assert deterministic_by_default("torch_native", cpu, switches) is expected
    assert deterministic_by_default("triton", cpu, switches) is False
    assert deterministic_by_default("auto", torch.device("cuda"), switches) is False
    assert deterministic_by_default("auto", cpu, KernelSwitches(cpu_attention_kernel=False)) is False
    no_half_weights = KernelSwitches(cpu_half_weight_linear=False)
    assert deterministic_by_default("auto", cpu, no_half_weights) is (expected and "avx512_bf16" in flags)
    dataset = write_jsonl(tmp_path / "in.jsonl", rows(2, 2))
    for flag, recorded in (((), expected), (("--no-deterministic",), False), (("--deterministic",), True)):
        generate(dataset, tmp_path / "out.arrow", random_models["llama"], "--dtype", "bfloat16", *flag)
        metadata = read_results(tmp_path / "out.arrow").schema.metadata
        assert metadata[b"batchgen.deterministic"] == str(recorded).lower().encode(), flag
