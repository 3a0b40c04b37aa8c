"""Linear layers of a few rows on half-precision weights (``batchgen.kernels.cpu.half_linear``): the float64
product within float32 summation's error bound, a row's bits independent of the other rows of a call, and
``PackedLinear`` running it for rounds of up to ``few_rows`` rows where its GEMMs run in float32."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from batchgen.kernels import cpu as cpu_kernels
from batchgen.kernels.cpu.half_linear import FEW_ROWS, half_weight_linear
from batchgen.models.packed_linear import PackedLinear, half_weight_rows

HALF = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def _kernels_built() -> None:
    problem = cpu_kernels.build_problem()
    if problem is not None:
        pytest.skip(f"the C++ kernels cannot be built on this machine: {problem}")


def _layer(dtype: torch.dtype, rows: int, in_features: int, out_features: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(dtype)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    return weight, bias, x


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("x_float32", [False, True])
@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    # Tiles of 1-4 rows by 8, 6, 4 or 3 columns in blocks of 24 columns, 8 or 16 lanes: remainders of each, an
    # inner dimension shorter than one vector and ones with a tail, and the shapes of a small Llama's layers.
    [
        (1, 1, 1),
        (2, 7, 2),
        (3, 20, 4),
        (4, 64, 5),
        (5, 100, 7),
        (7, 576, 192),
        (8, 1536, 576),
        (9, 576, 3072),
        (13, 40, 30),
        (16, 576, 25),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_the_float64_product_within_float32_summation_error(
    dtype: torch.dtype, x_float32: bool, rows: int, in_features: int, out_features: int, bias: bool
) -> None:
    """Each output is the float64 ``x W^T + b`` within float32 summation's bound ``(K + 1) u Σ|x_i w_i| + u|b|``
    (u = 2^-24; Higham, "Accuracy and Stability of Numerical Algorithms", §3.1): the products of half-precision
    values are exact in float32, so the sums are the only error."""
    weight, b, x = _layer(dtype, rows, in_features, out_features, rows * 1000 + in_features)
    x_in = x.float() if x_float32 else x
    got = half_weight_linear(x_in, weight, b if bias else None)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    exact = F.linear(x.double(), weight.double(), b.double() if bias else None)
    magnitudes = F.linear(x.double().abs(), weight.double().abs(), b.double().abs() if bias else None)
    assert ((got.double() - exact).abs() <= (in_features + 1) * 2.0**-24 * magnitudes + 1e-30).all()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("in_features", "out_features"), [(20, 7), (576, 192)])
def test_a_rows_output_is_the_same_bits_in_any_call(dtype: torch.dtype, in_features: int, out_features: int) -> None:
    """A row gives the same bits alone, at any place among 1 to 13 rows (every tile remainder), as in one call of
    40 rows: the kernel's sums run in one order per row, whatever the other rows."""
    weight, b, x = _layer(dtype, 40, in_features, out_features, in_features)
    reference = half_weight_linear(x, weight, b)
    for rows in range(1, 14):
        for start in (0, 1, 3, 27):
            got = half_weight_linear(x[start : start + rows], weight, b)
            assert torch.equal(got, reference[start : start + rows]), (rows, start)


def test_refuses_what_it_cannot_run() -> None:
    weight = torch.randn(3, 8).bfloat16()
    for x, w, message in (
        (torch.randn(2, 8).bfloat16(), torch.randn(3, 8), "weight must be bfloat16 or float16"),
        (torch.randn(2, 8).half(), weight, "x must be float32 or the weight's dtype"),
        (torch.randn(2, 9), weight, "must agree on in"),
        (torch.randn(8, 2).t(), weight, "contiguous"),
    ):
        with pytest.raises(RuntimeError, match=message):
            half_weight_linear(x, w, None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        half_weight_linear(torch.randn(2, 8), weight, torch.randn(3).bfloat16())


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("round_output", [True, False])
def test_packed_linear_runs_few_rows_on_the_half_weights(dtype: torch.dtype, round_output: bool) -> None:
    """With ``few_rows``, calls of up to that many rows give the kernel's result (rounded to the layer's dtype unless
    ``round_output`` is off), larger ones the float32 GEMM's, bit for bit."""
    weight, b, x = _layer(dtype, FEW_ROWS + 12, 576, 192, 7)
    bias = b.to(dtype)
    gemm = PackedLinear(weight, bias, torch.float32)
    few = PackedLinear(weight, bias, torch.float32, few_rows=FEW_ROWS)
    gemm.round_output = few.round_output = round_output
    want_dtype = dtype if round_output else torch.float32
    for rows in (1, 3, FEW_ROWS):
        kernel = half_weight_linear(x[:rows], weight, bias.float()).to(want_dtype)
        assert torch.equal(few(x[:rows]), kernel), rows
        assert torch.equal(few(x[:rows].float()), kernel), rows  # the float32 carrier's input
    for rows in (FEW_ROWS + 1, FEW_ROWS + 12):
        assert torch.equal(few(x[:rows]), gemm(x[:rows])), rows


def test_which_layers_read_their_half_weights() -> None:
    """Half-precision models whose GEMMs run in float32 (oneDNN without kernels in their dtype), the switch on;
    never under ``--deterministic`` (a row would take one kernel or the other by its round's size), nor where the
    GEMMs run in the model's dtype, nor for float32 models, nor without packing."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert half_weight_rows(bf16, f32, enabled=True, deterministic=False) == FEW_ROWS
    assert half_weight_rows(f16, f32, enabled=True, deterministic=False) == FEW_ROWS
    assert half_weight_rows(bf16, f32, enabled=False, deterministic=False) == 0
    assert half_weight_rows(bf16, f32, enabled=True, deterministic=True) == 0
    assert half_weight_rows(bf16, bf16, enabled=True, deterministic=False) == 0
    assert half_weight_rows(f32, f32, enabled=True, deterministic=False) == 0
    assert half_weight_rows(bf16, None, enabled=True, deterministic=False) == 0


def test_an_empty_inner_dimension_gives_the_bias() -> None:
    """``in_features`` 0: every product sum is empty, so each output is its bias (0 without one)."""
    bias = torch.randn(5)
    got = half_weight_linear(torch.empty(3, 0), torch.empty(5, 0, dtype=torch.bfloat16), bias)
    assert torch.equal(got, bias.expand(3, 5))
    assert torch.equal(
        half_weight_linear(torch.empty(2, 0), torch.empty(4, 0, dtype=torch.float16), None), torch.zeros(2, 4)
    )
