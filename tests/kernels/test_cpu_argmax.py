"""Greedy sampling's argmax on the CPU (``batchgen.kernels.cpu.argmax_rows``): torch.argmax's answer, the first
index of each row's maximum or of its first NaN, for every row the C++ op gets and those it leaves to torch."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import cpu as cpu_kernels
from batchgen.kernels.cpu import argmax_rows


@pytest.fixture(scope="module", autouse=True)
def _kernels_built() -> None:
    problem = cpu_kernels.build_problem()
    if problem is not None:
        pytest.skip(f"the C++ kernels cannot be built on this machine: {problem}")


def _expected(logits: torch.Tensor) -> list[int]:
    """First index of the maximum, NaN counting as the largest (torch.argmax's documented answer), by hand."""
    out = []
    for row in logits.tolist():
        nans = [i for i, v in enumerate(row) if v != v]
        out.append(nans[0] if nans else row.index(max(row)))
    return out


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1000, 32000])
def test_matches_torch_argmax_on_ties_nan_and_infinities(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=gen)
    logits[1] = 0.5  # all equal: index 0
    logits[2, vocab // 2 :] = 9.0  # a tie between the middle and the end: the first
    logits[3, vocab - 1] = float("nan")  # NaN wins, in the tail past the 16-lane chunks
    logits[4, [vocab // 3, vocab - 1]] = float("nan")  # the first NaN
    logits[5] = float("-inf")
    logits[6, vocab // 4] = float("inf")
    logits[7, -1] = 50.0
    got = argmax_rows(logits)
    assert got.dtype == torch.int64
    assert got.tolist() == _expected(logits) == torch.argmax(logits, dim=-1).tolist()


def test_strided_rows_and_other_inputs() -> None:
    """Rows of a wider tensor go to the op; float16, float64 and non-contiguous rows go to torch, same answer."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 1040, generator=gen)
    rows = wide[:, 7:1007]
    assert argmax_rows(rows).tolist() == _expected(rows)
    for other in (rows.half(), rows.double(), wide.t()):
        assert argmax_rows(other).tolist() == torch.argmax(other, dim=-1).tolist()
    assert argmax_rows(torch.empty(0, 5)).shape == (0,)
