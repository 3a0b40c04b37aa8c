"""Sampling's reductions on the CPU (``batchgen.kernels.cpu.sampling_ops``; ``batchgen.sampling.random``'s race
runs its op).

- ``argmax_rows``: torch.argmax's answer, the first index of each row's maximum or of its first NaN, for every row
  the C++ op gets and those it leaves to torch.
- ``log_softmax_at``: log_softmax at given ids, within float32 rounding of float64's exact value, NaN where torch
  gives NaN, the same bits for a row whatever the other rows.
- ``exponential_race``: the C++ op, which computes the noise only where a token could still win, picks what the
  whole race written in torch picks (``argmax w / E`` over every token, float64), and its winners follow the
  weights (χ², the exponential race's theorem).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from batchgen.kernels import cpu as cpu_kernels
from batchgen.kernels.cpu.sampling_ops import argmax_rows, log_softmax_at
from batchgen.sampling.random import exponential_noise, exponential_race, token_noise_keys


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


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1000, 49152])
def test_log_softmax_at_is_log_softmax_at_those_ids(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=gen) * 8
    logits[1] = 3.0  # all equal: -log(vocab) everywhere
    logits[2, vocab // 2] = 100.0  # one token takes nearly all the mass: the others far below
    logits[3, vocab - 1] = float("-inf")  # -inf in the tail past the vector loop: its logprob is -inf
    logits[4, vocab // 3] = float("nan")  # rows torch makes NaN: a NaN, all -inf, a +inf
    logits[5] = float("-inf")
    logits[6, vocab - 1] = float("inf")
    logits[7] = logits[7] + 1e4  # a large offset: the maximum is subtracted before exp
    ids = torch.randint(0, vocab, (12, 4), generator=gen)
    ids[:, 0] = vocab - 1
    got = log_softmax_at(logits, ids)
    exact = torch.log_softmax(logits.double(), dim=-1).gather(1, ids)
    assert got.dtype == torch.float32 and got.shape == (12, 4)
    nan = exact.isnan()
    assert torch.equal(got.isnan(), nan) and torch.equal(
        got.isnan(), torch.log_softmax(logits, -1).gather(1, ids).isnan()
    )
    torch.testing.assert_close(got[~nan].double(), exact[~nan], rtol=2e-6, atol=2e-6)
    # A row's values are the same bits alone and beside others, in any position, and from a strided view.
    for r in (0, 2, 7, 11):
        assert torch.equal(log_softmax_at(logits[r : r + 1], ids[r : r + 1]), got[r : r + 1])
    wide = torch.full((12, vocab + 9), 7.0)
    wide[:, 5 : 5 + vocab] = logits
    assert torch.equal(log_softmax_at(wide[:, 5 : 5 + vocab], ids).view(torch.int32), got.view(torch.int32))


def test_log_softmax_at_refuses_ids_outside_the_vocabulary() -> None:
    with pytest.raises(RuntimeError, match="outside"):
        log_softmax_at(torch.zeros(2, 10), torch.tensor([[3], [10]]))
    # Other inputs go to torch, which gives its own answer.
    logits = torch.randn(3, 50, dtype=torch.float64)
    ids = torch.tensor([[1], [2], [3]])
    assert torch.equal(log_softmax_at(logits, ids), torch.log_softmax(logits, -1).gather(1, ids))


def _keys(n: int, step: int = 3) -> torch.Tensor:
    return token_noise_keys(torch.arange(n, dtype=torch.int64) * 7919, torch.full((n,), step, dtype=torch.int64))


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1000, 49152])
def test_race_kernel_picks_the_whole_race_winner(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    n = 40
    weights = torch.softmax(torch.randn(n, vocab, generator=gen) * 4, dim=-1)
    weights[1::4, ::3] = 0.0  # truncated supports (top-k / top-p zeros)
    weights[2] = 0.0
    weights[2, vocab - 1] = 1.0  # one token left, in the tail past the vector loop
    weights[3] = 0.0  # nothing left: torch.argmax's answer
    weights[5, vocab // 2] = float("nan")  # a NaN never wins while a positive weight exists
    weights[7] = torch.arange(vocab, dtype=torch.float32) + 1  # increasing: every token is a record at first
    keys = _keys(n)
    # The race by hand: every token's ratio in float64, the first maximum; rows without a positive weight argmax.
    ratio = torch.where(weights > 0, weights.double() / exponential_noise(keys, vocab), 0.0)
    expected = [
        int(ratio[r].argmax()) if bool((weights[r] > 0).any()) else int(torch.argmax(weights[r])) for r in range(n)
    ]
    assert exponential_race(weights, keys).tolist() == expected
    assert exponential_race(weights, keys, use_kernel=False).tolist() == expected
    assert expected[2] == vocab - 1


def test_race_kernel_on_strided_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    wide = torch.rand(6, 1040, generator=gen)
    rows = wide[:, 7:1007]
    keys = _keys(6)
    assert exponential_race(rows, keys).tolist() == exponential_race(rows.contiguous(), keys, False).tolist()


def test_race_kernel_winners_follow_the_weights() -> None:
    """Over 20,000 rows (independent keys), each token wins in proportion to its weight: the minimum of
    independent exponentials E_i / w_i falls on i with probability w_i / Σ w."""
    vocab, n = 40, 20000
    weights = torch.linspace(0.0, 3.0, vocab) ** 2  # token 0 has weight 0: never drawn
    keys = _keys(n, step=11)
    won = exponential_race(weights.expand(n, vocab).contiguous(), keys)
    observed = torch.bincount(won, minlength=vocab).numpy()
    assert observed[0] == 0
    share = weights.double().numpy()[1:]
    expected = share / share.sum() * observed[1:].sum()
    assert chisquare(observed[1:], expected).pvalue > 1e-3
