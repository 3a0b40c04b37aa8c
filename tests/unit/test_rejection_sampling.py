"""Speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023) against the theorem it rests on: the
emitted token follows the target distribution p, and a draft drawn from q is accepted with probability
Σ min(p, q). Distributions here are written by hand; the draft is drawn from q in the test."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from batchgen.sampling.random import ACCEPT, DRAW, RESIDUAL, uniform_from_counter
from batchgen.sampling.rejection import DraftProposals, rejection_sample
from batchgen.sampling.sampler import sample
from batchgen.sampling.sampling_batch_info import SamplingBatchInfo
from batchgen.sampling.sampling_params import SamplingParams

ROWS = 20000
# Target and draft over 6 tokens: q puts mass where p has none (token 4) and misses one of p's (token 5).
P = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.00, 0.10])
Q = torch.tensor([0.10, 0.40, 0.20, 0.05, 0.25, 0.00])


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(dim=-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _verify(p: torch.Tensor, q: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Drafts drawn from ``q`` (the DRAW stream, as a draft model draws them), then verified against ``p``."""
    n = len(seeds)
    drafts = _inverse_cdf(q.expand(n, -1), uniform_from_counter(seeds, steps, DRAW))
    plain = _inverse_cdf(p.expand(n, -1), uniform_from_counter(seeds, steps, DRAW))
    proposals = DraftProposals(torch.arange(n), drafts, q.expand(n, -1).clone())
    emitted = rejection_sample(plain, p.expand(n, -1).clone(), seeds, steps, proposals)
    return drafts, emitted


def _assert_follows(observed: np.ndarray, probs: torch.Tensor) -> None:
    expected = probs.double().numpy()
    expected = expected / expected.sum()
    assert observed[expected == 0].sum() == 0, observed
    support = expected > 0
    assert chisquare(observed[support], expected[support] * observed.sum()).pvalue > 1e-3, observed


def test_emitted_tokens_follow_the_target_and_acceptance_is_the_overlap() -> None:
    seeds, steps = torch.arange(ROWS, dtype=torch.int64), torch.full((ROWS,), 7, dtype=torch.int64)
    drafts, emitted = _verify(P, Q, seeds, steps)
    _assert_follows(np.bincount(drafts.numpy(), minlength=6), Q)  # the drafts do come from q
    _assert_follows(np.bincount(emitted.numpy(), minlength=6), P)
    accepted = (emitted == drafts).double().mean().item()
    overlap = torch.minimum(P, Q).sum().item()  # 0.1 + 0.25 + 0.2 + 0.05 = 0.6
    assert overlap == pytest.approx(0.6)
    assert abs(accepted - overlap) < 4.5 * (overlap * (1 - overlap) / ROWS) ** 0.5
    # Where the draft is more likely under p than under q it is always accepted; a token p excludes never is.
    assert bool((emitted[drafts == 2] == 2).all()) and not bool((emitted == 4).any())


def test_a_one_hot_draft_is_accepted_with_the_target_probability() -> None:
    """A draft that is not sampled (n-gram, padding) has q = one-hot: accepted with probability p(d), and a
    rejection is drawn from p without d."""
    seeds, steps = torch.arange(ROWS, dtype=torch.int64), torch.zeros(ROWS, dtype=torch.int64)
    one_hot = torch.zeros(6).index_fill_(0, torch.tensor(1), 1.0)
    drafts, emitted = _verify(P, one_hot, seeds, steps)
    assert bool((drafts == 1).all())
    accepted = (emitted == 1).double().mean().item()
    assert abs(accepted - 0.25) < 4.5 * (0.25 * 0.75 / ROWS) ** 0.5
    _assert_follows(np.bincount(emitted[emitted != 1].numpy(), minlength=6), P.index_fill(0, torch.tensor(1), 0.0))


def test_identical_distributions_accept_every_draft() -> None:
    seeds, steps = torch.arange(2000, dtype=torch.int64), torch.full((2000,), 3, dtype=torch.int64)
    drafts, emitted = _verify(P, P, seeds, steps)
    assert torch.equal(drafts, emitted)


def test_streams_are_distinct_and_draw_is_unchanged() -> None:
    seeds, steps = torch.arange(5000, dtype=torch.int64), torch.arange(5000, dtype=torch.int64) % 17
    draw = uniform_from_counter(seeds, steps)
    assert torch.equal(draw, uniform_from_counter(seeds, steps, DRAW))
    accept, residual = uniform_from_counter(seeds, steps, ACCEPT), uniform_from_counter(seeds, steps, RESIDUAL)
    for a, b in [(draw, accept), (draw, residual), (accept, residual)]:
        assert abs(float(np.corrcoef(a.numpy(), b.numpy())[0, 1])) < 0.06
    for u in (accept, residual):
        assert float(u.min()) > 0.0 and float(u.max()) < 1.0 and abs(float(u.mean()) - 0.5) < 0.02


def test_sample_verifies_drafts_under_the_rows_own_processing() -> None:
    """Through :func:`sample`: the target's p is the processed distribution (here top-k 2 of the logits), so a
    draft outside it is always replaced, from the residual; rows outside ``info.drafts`` and greedy rows keep their
    own choice."""
    logits = torch.tensor([3.0, 2.5, 0.0, -1.0])
    n = 3000
    params = [SamplingParams(temperature=1.0, top_k=2)] * (n - 1) + [SamplingParams(temperature=0.0)]
    info = SamplingBatchInfo.from_params(params, list(range(n)), [4] * n, [[]] * n, 4, torch.device("cpu"))
    plain = sample(logits.expand(n, 4).clone(), info).next_token_ids
    # Every other row, and the greedy last one, verify a draft of token 2 (outside the top 2) drawn from uniform q.
    rows = torch.cat([torch.arange(0, n - 1, 2), torch.tensor([n - 1])])
    info.drafts = DraftProposals(rows, torch.full((len(rows),), 2), torch.full((len(rows), 4), 0.25))
    out = sample(logits.expand(n, 4).clone(), info).next_token_ids
    assert not bool((out == 2).any())
    kept = torch.ones(n, dtype=torch.bool)
    kept[rows] = False
    kept[-1] = True  # greedy: the argmax whatever the draft
    assert torch.equal(out[kept], plain[kept]) and out[-1].item() == 0
    # Every draft is rejected (p(2) = 0) and redrawn from norm(max(p - q, 0)), p the top-2 softmax.
    residual = (torch.softmax(torch.tensor([3.0, 2.5]), dim=0) - 0.25).clamp(min=0)
    _assert_follows(np.bincount(out[rows[:-1]].numpy(), minlength=4), torch.cat([residual, torch.zeros(2)]))
