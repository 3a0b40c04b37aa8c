"""``--deterministic`` on the GPU path (attention backend triton: its attention kernels, its batch-invariant GEMM for
every linear layer and the LM head, its per-row norm/SiLU/RoPE kernels), run here by Triton's interpreter on the
CPU: a row's output bytes do not depend on the batch it ran in or on how its prompt was chunked. The right value is
the same row run another way (tests/e2e/test_deterministic.py holds the CPU path to the same comparisons).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.triton import use_triton_interpreter

use_triton_interpreter()

from batchgen.errors import BatchgenError  # noqa: E402
from batchgen.kernels.attention import deterministic_backend  # noqa: E402
from batchgen.kernels.attention.triton_backend import TritonAttnBackend  # noqa: E402
from batchgen.kernels.triton import decode_attention  # noqa: E402
from batchgen.models.triton_linear import TritonLinear  # noqa: E402
from tests.e2e.test_deterministic import columns, rows  # noqa: E402
from tests.helpers.cli import generate, run_args, run_cli, write_jsonl  # noqa: E402

TRITON = ("--attention-backend", "triton", "--deterministic")
# Against the reference's 8 rows a round and unchunked prompts: each row alone in its rounds, its prompt in chunks of
# 16 (the longer prompts take two or more; the shortest is the next one's prefix, so that one comes from the cache).
# One run for both ways: the interpreter takes about 2 ms a program.
REFERENCE = ["--max-running-requests", "8", "--chunked-prefill-size", "0"]
OTHER_WAY = ["--max-running-requests", "1", "--chunked-prefill-size", "16"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_are_identical_however_the_job_runs(
    dtype: str, random_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy and temperature-1.0 rows (each its own seed) of a tiny random Llama: byte-identical ids, logprobs,
    top logprobs and finish reasons between 8 rows a round with whole prompts and one row a round with prompts in
    chunks of 16. The runs do go through Triton's GEMM and decode rounds (counted), never through the
    Flash-Decoding kernel."""
    calls = {"gemm": 0, "decode": 0}
    gemm, decode = TritonLinear.forward, TritonAttnBackend.forward_decode

    def count_gemm(self: TritonLinear, x: torch.Tensor) -> torch.Tensor:
        calls["gemm"] += 1
        return gemm(self, x)

    def count_decode(self: TritonAttnBackend, *args: Any) -> torch.Tensor:
        calls["decode"] += 1
        return decode(self, *args)

    def split_kernel(*args: Any) -> torch.Tensor:
        raise AssertionError("Flash-Decoding's split kernel under --deterministic")

    monkeypatch.setattr(TritonLinear, "forward", count_gemm)
    monkeypatch.setattr(TritonAttnBackend, "forward_decode", count_decode)
    monkeypatch.setattr(decode_attention, "decode_attention_fwd", split_kernel)
    dataset = write_jsonl(tmp_path / "in.jsonl", rows(4, 5))
    model = random_models["llama"]
    flags = ("--dtype", dtype, *TRITON)
    reference = columns(generate(dataset, tmp_path / "ref.arrow", model, *flags, *REFERENCE))
    assert calls["gemm"] > 0 and calls["decode"] > 0, calls
    assert len(set(reference.values())) == 4  # rows do differ from each other
    assert columns(generate(dataset, tmp_path / "out.arrow", model, *flags, *OTHER_WAY)) == reference


def test_deterministic_backends() -> None:
    """auto is torch_native on the CPU and triton on CUDA; flashinfer is refused, and torch_native off the CPU."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert deterministic_backend("auto", cpu) == "torch_native"
    assert deterministic_backend("auto", cuda) == "triton"
    assert deterministic_backend("triton", cpu) == deterministic_backend("triton", cuda) == "triton"
    with pytest.raises(BatchgenError, match="flashinfer"):
        deterministic_backend("flashinfer", cuda)
    with pytest.raises(BatchgenError, match="triton, not torch_native"):
        deterministic_backend("torch_native", cuda)


def test_flashinfer_is_refused_in_one_line(random_models: dict[str, Path], tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "in.jsonl", rows(1, 2))
    args = run_args(dataset, tmp_path / "out.arrow", random_models["llama"], "--deterministic")
    code, output = run_cli([*args, "--attention-backend", "flashinfer"])
    assert code != 0
    assert output.strip().count("\n") == 0 and "flashinfer" in output, output
