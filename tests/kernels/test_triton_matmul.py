"""batchgen's batch-invariant Triton GEMM, run by Triton's interpreter on the CPU: ``x @ W^T + b`` against float64,
and each row's bits the same whatever the row count and wherever the row sits in the batch.

bfloat16 in the interpreter is upcast to float32 before the product (see :func:`batchgen.kernels.triton.dot_settings`),
so its cases check the loads, the float32 accumulation and the one rounding at the end; float16 runs natively.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.triton import use_triton_interpreter

use_triton_interpreter()

from batchgen.kernels.triton.matmul import matmul, matmul_tiles  # noqa: E402
from batchgen.models.triton_linear import TritonLinear  # noqa: E402
from tests.helpers.batch_invariance import (  # noqa: E402
    assert_matmul_matches_float64,
    assert_matmul_rows_independent_of_batch,
    matmul_operands,
)

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# One rounding of a unit-scale output to the dtype, plus float32 sums over K <= 300 terms.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
# (N, K): K shorter than a step, not a multiple of it, several steps; N narrow (32-wide tiles) and wide (64-wide).
SHAPES = [(40, 16), (100, 70), (96, 300), (4160, 64)]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_matmul_matches_float64(dtype: torch.dtype, n: int, k: int) -> None:
    assert_matmul_matches_float64(n, k, dtype, CPU, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize(("n", "k"), [(100, 70), (96, 300)])
def test_a_rows_bits_do_not_depend_on_the_batch(dtype: torch.dtype, n: int, k: int) -> None:
    """Row counts 1, 3, 17 and 64, a second row tile, shuffled rows: each row's bits are its own alone."""
    assert_matmul_rows_independent_of_batch(n, k, dtype, CPU, batch_sizes=(1, 3, 17, 64))


def test_tiles_depend_on_the_output_width_and_dtype_only() -> None:
    """The launch's tiles are a function of (N, dtype): the row count is not even an argument."""
    assert matmul_tiles(4096, torch.bfloat16).block_n == 32 and matmul_tiles(4097, torch.bfloat16).block_n == 64
    assert matmul_tiles(128, torch.float32).block_k == 32 and matmul_tiles(128, torch.float16).block_k == 64


def test_triton_linear_is_the_linear_layer() -> None:
    """Against ``F.linear`` in float32 on the same weights (nn.Linear's layout), with and without bias."""
    gen = torch.Generator().manual_seed(4)
    layer = torch.nn.Linear(48, 80).requires_grad_(False)
    torch.nn.init.normal_(layer.weight, generator=gen)
    x = torch.randn(5, 48, generator=gen)
    for bias in (layer.bias, None):
        want = torch.nn.functional.linear(x, layer.weight, bias)
        got = TritonLinear(layer.weight, bias)(x)
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-6


def test_mismatched_operands_are_a_clear_error() -> None:
    x, w, b = matmul_operands(40, 16, torch.float32, CPU, seed=0)
    with pytest.raises(ValueError, match="matmul of x"):
        matmul(x, w[:, :8])
    with pytest.raises(ValueError, match="matmul of x"):
        matmul(x, w, b.to(torch.float16))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        matmul(x.T.contiguous().T, w)
