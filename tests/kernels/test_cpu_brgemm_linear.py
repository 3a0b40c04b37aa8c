"""bfloat16 linear layers on PyTorch's brgemm (``batchgen.kernels.cpu.brgemm_linear``, ``--deterministic``'s GEMM
where brgemm has bfloat16): the float64 product within float32 summation's error bound, and a row's bits
independent of the other rows of a call, of its place among them and of the call's size; the gate/up projection
with SwiGLU's activation in one pass, bit for bit the two ops it replaces."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.cpu import brgemm_bf16_supported
from batchgen.kernels.cpu.brgemm_linear import (
    COLUMN_BLOCK,
    brgemm_linear,
    brgemm_linear_silu_and_mul,
    pack_for_brgemm,
)
from batchgen.kernels.cpu.fused_elementwise import silu_and_mul


@pytest.fixture(scope="module", autouse=True)
def _brgemm_runs() -> None:
    if not brgemm_bf16_supported():
        pytest.skip("PyTorch's brgemm has no bfloat16 on this CPU (it needs AVX512-BF16 or AMX), or no C++ kernels")


def _layer(rows: int, in_features: int, out_features: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).bfloat16()
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    return weight, bias, x


# Row blocks of 128 and column blocks of 64 with and without remainders; an inner dimension of one pair; the shapes
# of a small Llama's layers and of an LM head.
SHAPES = [(1, 2, 1), (3, 10, 64), (5, 64, 65), (130, 576, 192), (129, 1536, 576), (257, 576, 1000), (2, 576, 8192)]


@pytest.mark.parametrize(("rows", "in_features", "out_features"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_the_float64_product_within_float32_summation_error(
    rows: int, in_features: int, out_features: int, bias: bool
) -> None:
    """Each output is the float64 ``x W^T + b`` within float32 summation's bound ``(K + 1) u Σ|x_i w_i| + u|b|``
    (u = 2^-24; Higham, "Accuracy and Stability of Numerical Algorithms", §3.1): products of bfloat16 values are
    exact in float32, so the sums are the only error."""
    weight, b, x = _layer(rows, in_features, out_features, rows * 1000 + in_features)
    out = brgemm_linear(x, pack_for_brgemm(weight), out_features, b if bias else None)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    exact = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias:
        exact += b.double()
    u = 2.0**-24
    bound = (in_features + 1) * u * magnitude + (u * b.double().abs() if bias else 0.0)
    assert bool(((out.double() - exact).abs() <= bound).all())
    # Rounded in the kernel: each float32 result rounded once, to nearest even, as PyTorch's own conversion does.
    rounded = brgemm_linear(x, pack_for_brgemm(weight), out_features, b if bias else None, round_to_bf16=True)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, out.bfloat16())


@pytest.mark.parametrize(
    ("in_features", "out_features"), [(64, 192), (576, 960), (1536, 576), (576, 8192), (66, 130), (578, 136)]
)
def test_a_rows_bits_do_not_depend_on_the_other_rows(in_features: int, out_features: int) -> None:
    """A row's output is the same bits in every window of 1 to 300 rows (at three offsets, so across the
    128-row blocks of a call at every place) as in one call of 600 rows."""
    weight, b, x = _layer(600, in_features, out_features, in_features + out_features)
    packed = pack_for_brgemm(weight)
    reference = brgemm_linear(x, packed, out_features, b)
    for rows in [*range(1, 140), 255, 256, 257, 300]:
        for start in (0, 3, 127):
            window = brgemm_linear(x[start : start + rows], packed, out_features, b, round_to_bf16=rows % 2 == 0)
            assert torch.equal(window.float(), reference[start : start + rows].to(window.dtype).float()), (rows, start)


def test_a_rows_bits_with_extreme_values_do_not_depend_on_the_other_rows() -> None:
    """Rows holding subnormal, huge, infinite and NaN inputs give the same bits alone and among 6 (tiles of one group
    of rows), among 12 (brgemm's tiles) and among 64 or 200 (tiles of many rows): tiles of one group and of many
    run on another code path than brgemm where the CPU allows, with brgemm's bits; in the float32 output and the
    gate/up pass."""
    weight, b, x = _layer(212, 576, 192, 11)
    specials = torch.tensor([1e-39, -1e-39, 3e38, -3e38, 1e-30, float("inf"), float("-inf"), float("nan")])
    for i, value in enumerate(specials):
        x[5 + 7 * i, 3 * i : 3 * i + 40 : 5] = value
    x[60, :] = 3e38  # sums that overflow to inf
    weight[7, :] = -1e-38  # a column of subnormal products
    packed = pack_for_brgemm(weight)
    gate_up = pack_for_brgemm(_layer(1, 576, 2 * 192, 12)[0])

    def both(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return brgemm_linear(rows, packed, 192, b).view(torch.int32), brgemm_linear_silu_and_mul(
            rows, gate_up, 192
        ).view(torch.int16)

    for rows in (64, 200):
        many = both(x[:rows])
        for r in [*range(5, 5 + 7 * len(specials), 7), 60, rows - 1]:
            for window in (1, 6, 12):
                alone = both(x[r : r + window])
                assert torch.equal(alone[0][:1], many[0][r : r + 1]), (rows, r, window)
                assert torch.equal(alone[1][:1], many[1][r : r + 1]), (rows, r, window)


@pytest.mark.parametrize("threads", [1, 3, 4])
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(1, 576, 576), (64, 1536, 576), (300, 64, 65)])
def test_a_rows_bits_do_not_depend_on_the_threads(rows: int, in_features: int, out_features: int, threads: int) -> None:
    """The same bits on 1, 3 or 4 threads as on 2, where tiles that do not divide among the threads are split by
    columns into a part per thread (9 blocks of 576 columns; 3 row blocks of 65 columns, whose last block of one
    column leaves some parts empty); and for the gate/up pass's 3 blocks of each half."""
    weight, b, x = _layer(rows, in_features, out_features, rows + threads)
    packed = pack_for_brgemm(weight)
    gate_up = pack_for_brgemm(_layer(1, in_features, 2 * 192, threads)[0])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        reference = brgemm_linear(x, packed, out_features, b), brgemm_linear_silu_and_mul(x, gate_up, 192)
        torch.set_num_threads(threads)
        got = brgemm_linear(x, packed, out_features, b), brgemm_linear_silu_and_mul(x, gate_up, 192)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[0].view(torch.int32), reference[0].view(torch.int32))
    assert torch.equal(got[1].view(torch.int16), reference[1].view(torch.int16))


def test_the_packed_layout_is_brgemms_vnni_blocks() -> None:
    """Block ``j``, pair ``p``, column ``c``, lane ``l`` holds ``W[j * 64 + c, 2p + l]``, every element checked on
    weights of distinct bit patterns; columns past ``out`` are zero; an odd inner dimension is refused."""
    out_features, in_features = 130, 6
    weight = torch.arange(1, out_features * in_features + 1, dtype=torch.int16).view(torch.bfloat16)
    weight = weight.view(out_features, in_features)
    packed = pack_for_brgemm(weight).view(torch.int16)
    bits = weight.view(torch.int16)
    assert packed.shape == (3, in_features // 2, COLUMN_BLOCK, 2)
    for j, p, c, lane in torch.cartesian_prod(*(torch.arange(n) for n in packed.shape)).tolist():
        row = j * COLUMN_BLOCK + c
        expected = int(bits[row, 2 * p + lane]) if row < out_features else 0
        assert int(packed[j, p, c, lane]) == expected, (j, p, c, lane)
    with pytest.raises(ValueError, match="even width"):
        pack_for_brgemm(torch.zeros(4, 5, dtype=torch.bfloat16))


def test_mismatched_inputs_are_refused_in_one_line() -> None:
    weight, _, x = _layer(4, 64, 96, 0)
    packed = pack_for_brgemm(weight)
    with pytest.raises(RuntimeError, match="batchgen::brgemm_linear: x and packed must be bfloat16"):
        brgemm_linear(x.float(), packed, 96, None)
    with pytest.raises(RuntimeError, match="must agree on K"):
        brgemm_linear(x[:, :32].contiguous(), packed, 96, None)
    with pytest.raises(RuntimeError, match="cannot hold out_features 200"):
        brgemm_linear(x, packed, 200, None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        brgemm_linear(x, packed, 96, torch.zeros(96, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x has no columns"):
        brgemm_linear(x[:, :0].contiguous(), packed[:, :0].contiguous(), 96, None)


def test_no_rows_give_an_empty_output() -> None:
    weight, b, _ = _layer(1, 64, 96, 0)
    out = brgemm_linear(torch.zeros(0, 64, dtype=torch.bfloat16), pack_for_brgemm(weight), 96, b)
    assert out.shape == (0, 96)


@pytest.mark.parametrize(
    ("rows", "in_features", "intermediate"), [(0, 64, 64), (1, 64, 64), (3, 576, 1536), (300, 576, 192)]
)
def test_the_gate_up_projection_with_its_activation_gives_the_two_ops_bits(
    rows: int, in_features: int, intermediate: int
) -> None:
    """Every row's output is bit for bit ``silu_and_mul(brgemm_linear(x, W, rounded))`` (row blocks of 128 with and
    without remainders, large gates where SiLU saturates, negative ones deep in its tail), and ``silu(g) * up`` of
    the float64 products within what its four roundings to bfloat16 (unit roundoff u = 2^-8) can move it: g's, by
    as much as SiLU moves between g (1 - u) and g (1 + u), then SiLU's, up's and the product's."""
    weight, _, x = _layer(rows, in_features, 2 * intermediate, rows + intermediate)
    weight[: intermediate // 4] *= 40  # gates from about -200 to 200
    packed = pack_for_brgemm(weight)
    fused = brgemm_linear_silu_and_mul(x, packed, intermediate)
    two_ops = silu_and_mul(brgemm_linear(x, packed, 2 * intermediate, None, round_to_bf16=True))
    assert fused.dtype == torch.bfloat16 and fused.shape == (rows, intermediate)
    assert torch.equal(fused.view(torch.int16), two_ops.view(torch.int16))
    gate_up = x.double() @ weight.double().T
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
    # Below -88.72 float32's exp(-g) overflows and PyTorch's float32 SiLU, g / (1 + exp(-g)), is 0: so is the kernel's.
    exact = torch.where(gate < -88.72283935546875, 0.0, torch.nn.functional.silu(gate)) * up
    u = 2.0**-8
    silu = torch.nn.functional.silu
    moved = torch.maximum((silu(gate * (1 + u)) - silu(gate)).abs(), (silu(gate * (1 - u)) - silu(gate)).abs())
    bound = 1.01 * (moved * up.abs() * (1 + u) ** 2 + 3 * u * exact.abs())
    assert bool(((fused.double() - exact).abs() <= bound + 1e-40).all())


def test_the_activation_pass_keeps_the_two_ops_bits_for_inf_and_nan() -> None:
    """Rows holding inf, -inf, NaN and float32-overflowing values give the two ops' bits, NaN included (one quiet
    NaN, as c10 rounds)."""
    weight, _, x = _layer(6, 64, 128, 5)
    x[1, 3], x[2, 7], x[3, 0], x[4] = float("inf"), float("-inf"), float("nan"), 3e38
    packed = pack_for_brgemm(weight)
    fused = brgemm_linear_silu_and_mul(x, packed, 64)
    two_ops = silu_and_mul(brgemm_linear(x, packed, 128, None, round_to_bf16=True))
    assert torch.equal(fused.view(torch.int16), two_ops.view(torch.int16))
    assert bool(fused[1:5].isnan().any()) and not bool(fused[[0, 5]].isnan().any())


def test_the_activation_pass_refuses_a_weight_without_two_whole_halves() -> None:
    weight, _, x = _layer(2, 64, 2 * COLUMN_BLOCK + 2, 0)
    with pytest.raises(RuntimeError, match="must hold gate and up halves of intermediate 65, each a whole number"):
        brgemm_linear_silu_and_mul(x, pack_for_brgemm(weight), COLUMN_BLOCK + 1)
    with pytest.raises(RuntimeError, match="batchgen::brgemm_linear_silu_and_mul: x and packed must be bfloat16"):
        brgemm_linear_silu_and_mul(x.float(), pack_for_brgemm(weight[: 2 * COLUMN_BLOCK]), COLUMN_BLOCK)
