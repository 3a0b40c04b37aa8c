"""``--deterministic`` on CUDA (attention backend triton), marked ``cuda`` and skipped without CUDA; the same checks
run in Triton's interpreter on the CPU (tests/kernels/test_triton_matmul.py, test_triton_attention.py,
tests/e2e/test_deterministic_triton.py), where the products are numpy's, not the tensor cores'.

- The batch-invariant GEMM compiled: a row's bits equal across row counts 1 to 1000 at Llama-1B's shapes (and its
  LM head's), within float64's tolerance.
- The attention kernels compiled: a query decoded and attended inside prefill chunks of many shapes, same bits.
- Whole jobs on a tiny random Llama: byte-identical rows (greedy and temperature 1.0) across batch sizes, chunked
  prefill, the prefix cache, n-gram speculative decoding and CUDA graphs on and off, in float32 and bfloat16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.test_deterministic import columns, rows
from tests.helpers.batch_invariance import (
    assert_matmul_matches_float64,
    assert_matmul_rows_independent_of_batch,
    assert_query_bits_independent_of_round,
)
from tests.helpers.cli import generate, write_jsonl

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

CUDA = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
# Llama-1B's q/k/v, gate/up and down projections, and a vocabulary-sized LM head.
SHAPES = [(3072, 2048), (16384, 2048), (2048, 8192), (32000, 2048)]
WAYS = {
    "one row a round, eager": ["--max-running-requests", "1", "--disable-cuda-graph"],
    "8 rows, chunks of 16": ["--max-running-requests", "8", "--chunked-prefill-size", "16"],
    "no prefix cache, 3 rows": ["--no-prefix-cache", "--max-running-requests", "3"],
    "n-gram speculative": ["--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "3"],
}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_matmul_rows_do_not_depend_on_the_batch(dtype: torch.dtype, n: int, k: int) -> None:
    assert_matmul_matches_float64(n, k, dtype, CUDA, TOLERANCE[dtype] * (4 if dtype == torch.float32 else 1))
    assert_matmul_rows_independent_of_batch(n, k, dtype, CUDA, batch_sizes=(1, 3, 17, 64, 200, 1000))


@pytest.mark.parametrize(
    "shape", [(torch.float32, 64, 4), (torch.bfloat16, 64, 1), (torch.bfloat16, 128, 4), (torch.float16, 128, 8)]
)
def test_a_querys_bits_do_not_depend_on_its_round(shape: tuple[torch.dtype, int, int]) -> None:
    dtype, head_dim, group = shape
    assert_query_bits_independent_of_round(dtype, head_dim, group, CUDA, 2e-2 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_are_identical_however_the_job_runs(dtype: str, random_models: dict[str, Path], tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "in.jsonl", rows())
    # Graphs up to 8 rows: the reference's 12-row rounds run eagerly, its smaller ones and the other ways' replay.
    flags = ("--device", "cuda", "--dtype", dtype, "--attention-backend", "triton", "--deterministic")
    flags += ("--cuda-graph-max-bs", "8")
    reference = columns(generate(dataset, tmp_path / "ref.arrow", random_models["llama"], *flags))
    assert len(set(reference.values())) == len(reference)
    for way, extra in WAYS.items():
        got = columns(generate(dataset, tmp_path / "out.arrow", random_models["llama"], *flags, *extra))
        assert got == reference, way
