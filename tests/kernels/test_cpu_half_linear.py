"""Linear layers on half-precision weights computed in float32 (``batchgen.kernels.cpu.half_linear``): the float64
product within float32 summation's error bound, each output the ordered chain of fused multiply-adds (computed in
exact rationals), a row's bits independent of the other rows of a call and of the route its round takes, and
``PackedLinear`` running every call on it where its GEMMs run in float32."""

from __future__ import annotations

import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from batchgen.kernels import cpu as cpu_kernels
from batchgen.kernels.cpu.half_linear import COLUMN_BLOCK, half_weight_linear, pack_half_weight, routes_agree
from batchgen.models.packed_linear import PackedLinear, half_weight_runs
from tests.helpers.models import REPO

HALF = [torch.bfloat16, torch.float16]
STREAM_ROWS = 8  # the most rows a round runs on stream tiles with AVX-512 (kStreamRows in half_linear.cpp)
STREAM_ROWS_AVX2 = 12  # and without


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


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return half_weight_linear(x, pack_half_weight(weight), weight.shape[0], bias)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("x_float32", [False, True])
@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    # Stream tiles of 1-8 rows (groups of up to 4 rows on AVX-512, 6 on AVX2) and brgemm tiles past 8 rows, blocks
    # of 64 columns and a narrower last one, an inner dimension shorter than one vector, one row tile of 128 and two,
    # and a small Llama's shapes.
    [
        (1, 1, 1),
        (2, 7, 2),
        (3, 20, 4),
        (4, 64, 65),
        (5, 100, 7),
        (7, 576, 192),
        (8, 1536, 576),
        (9, 576, 3072),
        (13, 40, 30),
        (16, 576, 25),
        (130, 96, 130),
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
    got = _linear(x_in, weight, b if bias else None)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    exact = F.linear(x.double(), weight.double(), b.double() if bias else None)
    magnitudes = F.linear(x.double().abs(), weight.double().abs(), b.double().abs() if bias else None)
    assert ((got.double() - exact).abs() <= (in_features + 1) * 2.0**-24 * magnitudes + 1e-30).all()


def _round_to_float32(exact: Fraction) -> float:
    """``exact`` rounded to the nearest float32, ties to even (IEEE 754's default), by exact comparison with the
    float32 neighbours of its float64 rounding (so no double rounding)."""
    guess = np.float32(float(exact))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    finite = [c for c in candidates if np.isfinite(c)]

    def key(c: np.float32) -> tuple[Fraction, int]:
        return abs(Fraction(float(c)) - exact), int(np.float32(c).view(np.int32)) & 1

    return float(min(finite, key=key))


def _fma_chain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Each output as ``s = fma(x_k, w_k, s)`` over ``k`` in order from ``s = 0``, each step the exact
    ``x_k w_k + s`` rounded once to float32 (an IEEE 754 fused multiply-add, computed here in exact rationals),
    then the bias added in float32."""
    xs, ws = x.float().tolist(), weight.float().tolist()
    out = torch.empty(len(xs), len(ws))
    for i, row in enumerate(xs):
        for j, col in enumerate(ws):
            s = 0.0
            for a, w in zip(row, col, strict=True):
                s = _round_to_float32(Fraction(a) * Fraction(w) + Fraction(s))
            out[i, j] = torch.tensor(s) + bias[j]
    return out


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rows", [1, 3, 6, STREAM_ROWS, STREAM_ROWS + 1, STREAM_ROWS_AVX2 + 1])
def test_each_output_is_the_ordered_chain_of_fused_multiply_adds(dtype: torch.dtype, rows: int) -> None:
    """On both routes (stream tiles up to 8 rows, brgemm past them) every output is the float32 FMA chain over the
    inner dimension in order, then the bias: the order that makes a row's result its own. ``x`` in float32 (the
    carrier's), whose products with the weights need more than float32's 24 bits, so a multiply rounded before its
    add would show."""
    weight, b, _ = _layer(dtype, rows, 37, 70, rows)
    x = torch.randn(rows, 37, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(_linear(x, weight, b), _fma_chain(x, weight, b))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("in_features", "out_features"), [(20, 7), (576, 192)])
def test_a_rows_output_is_the_same_bits_in_any_call(dtype: torch.dtype, in_features: int, out_features: int) -> None:
    """A row gives the same bits alone, at any place among 1 to 13 rows (both routes, every group remainder), as in
    one call of 300 rows (three row tiles): the kernel's sums run in one order per row, whatever the other rows."""
    weight, b, x = _layer(dtype, 300, in_features, out_features, in_features)
    reference = _linear(x, weight, b)
    for rows in range(1, 14):
        for start in (0, 1, 3, 27, 280):
            got = _linear(x[start : start + rows], weight, b)
            assert torch.equal(got, reference[start : start + rows]), (rows, start)


def test_both_routes_agree_here() -> None:
    """The run-time check that brgemm forms the stream tiles' chain holds on this CPU (where it did not,
    half-precision models would run their GEMMs on float32 copies; the check is what this suite would catch)."""
    assert routes_agree()


def _rows_own_bits(dtype: torch.dtype) -> None:
    weight, b, _ = _layer(dtype, 1, 1037, 70, 5)
    x = torch.randn(300, 1037, generator=torch.Generator().manual_seed(5))
    whole = _linear(x, weight, b)
    for start, rows in ((0, 1), (7, 9), (100, 130)):
        assert torch.equal(_linear(x[start : start + rows], weight, b), whole[start : start + rows])
    assert torch.equal(whole[:2], _fma_chain(x[:2], weight, b))


@pytest.mark.parametrize("dtype", HALF)
def test_with_onednn_switched_off_every_round_takes_stream_tiles(dtype: torch.dtype) -> None:
    """``torch.backends.mkldnn.enabled = False`` turns PyTorch's float32 brgemm into its sgemm fallback, which
    blocks the sum (a reviewer found rows of 300 no longer their own): the check, read on every call, then fails,
    and every round runs the stream tiles' chain."""
    torch._C._set_mkldnn_enabled(False)
    try:
        assert not torch.ops.batchgen.half_linear_routes_agree()
        _rows_own_bits(dtype)
    finally:
        torch._C._set_mkldnn_enabled(True)
    assert torch.ops.batchgen.half_linear_routes_agree()


_BELOW_AVX2 = """
import torch
from batchgen.kernels.cpu.half_linear import routes_agree
from batchgen.models.packed_linear import half_weight_runs
from tests.kernels.test_cpu_half_linear import _rows_own_bits
_rows_own_bits(torch.bfloat16)
print(routes_agree(), half_weight_runs(torch.bfloat16, torch.float32, True))
"""


def test_below_avx2_the_layers_take_float32_copies() -> None:
    """oneDNN capped below AVX2 (``ONEDNN_MAX_CPU_ISA=SSE41``, as on CPUs with AVX and no AVX2): brgemm falls back
    to sgemm, the check says so, models take float32 copies for oneDNN, and the kernel itself stays row-invariant."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "SSE41"}
    done = subprocess.run([sys.executable, "-c", _BELOW_AVX2], env=env, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


def test_the_packed_layout() -> None:
    """Blocks of 64 output columns, each ``W^T``'s rows for them, the last padded with zero columns."""
    weight = torch.arange(70 * 3, dtype=torch.float32).view(70, 3).bfloat16()
    packed = pack_half_weight(weight)
    assert packed.shape == (2, 3, COLUMN_BLOCK) and packed.dtype == torch.bfloat16
    assert torch.equal(packed[0], weight[:64].t())
    assert torch.equal(packed[1, :, :6], weight[64:].t()) and not packed[1, :, 6:].any()
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        pack_half_weight(torch.randn(3, 4))


def test_refuses_what_it_cannot_run() -> None:
    packed = pack_half_weight(torch.randn(3, 8).bfloat16())
    for x, w, n, message in (
        (torch.randn(2, 8).bfloat16(), torch.randn(1, 8, 64), 3, "packed must be bfloat16 or float16"),
        (torch.randn(2, 8).half(), packed, 3, "x must be float32 or the weight's dtype"),
        (torch.randn(2, 9), packed, 3, "must agree on K"),
        (torch.randn(2, 8), packed, 65, "cannot hold out_features 65"),
        (torch.randn(8, 2).t(), packed, 3, "contiguous"),
    ):
        with pytest.raises(RuntimeError, match=message):
            half_weight_linear(x, w, n, None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        half_weight_linear(torch.randn(2, 8), packed, 3, torch.randn(3).bfloat16())


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("round_output", [True, False])
def test_packed_linear_runs_every_call_on_the_half_weights(dtype: torch.dtype, round_output: bool) -> None:
    """With ``half_weight``, calls of any row count give the kernel's result (rounded to the layer's dtype unless
    ``round_output`` is off), from the layer's dtype or the float32 carrier alike, and keep no float32 copy."""
    weight, b, x = _layer(dtype, 40, 576, 192, 7)
    bias = b.to(dtype)
    layer = PackedLinear(weight, bias, torch.float32, half_weight=True)
    layer.round_output = round_output
    assert not hasattr(layer, "packed")
    want_dtype = dtype if round_output else torch.float32
    for rows in (1, 3, STREAM_ROWS, STREAM_ROWS + 1, 40):
        kernel = _linear(x[:rows], weight, bias.float()).to(want_dtype)
        assert torch.equal(layer(x[:rows]), kernel), rows
        assert torch.equal(layer(x[:rows].float()), kernel), rows


def test_which_layers_read_their_half_weights() -> None:
    """Half-precision models whose GEMMs run in float32 (oneDNN without kernels in their dtype), the switch on;
    not where the GEMMs run in the model's dtype, nor for float32 models, nor without packing."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert half_weight_runs(bf16, f32, enabled=True)
    assert half_weight_runs(f16, f32, enabled=True)
    assert not half_weight_runs(bf16, f32, enabled=False)
    assert not half_weight_runs(bf16, bf16, enabled=True)
    assert not half_weight_runs(f32, f32, enabled=True)
    assert not half_weight_runs(bf16, None, enabled=True)


def test_an_empty_inner_dimension_gives_the_bias() -> None:
    """``in_features`` 0: every product sum is empty, so each output is its bias (0 without one)."""
    bias = torch.randn(5)
    got = _linear(torch.empty(3, 0), torch.empty(5, 0, dtype=torch.bfloat16), bias)
    assert torch.equal(got, bias.expand(3, 5))
    assert torch.equal(_linear(torch.empty(2, 0), torch.empty(4, 0, dtype=torch.float16), None), torch.zeros(2, 4))
