"""The sampler's noise and what it buys: exponential noise per (seed, step, token) that is Exp(1), and draws that a
rounding-sized change of the logits rarely flips (Gumbel-max's bound, computed by hand below)."""

from __future__ import annotations

import torch
from scipy.stats import kstest

from batchgen.sampling.random import ACCEPT, DRAW, RESIDUAL, exponential_noise, token_noise_keys
from batchgen.sampling.sampler import sample
from batchgen.sampling.sampling_batch_info import SamplingBatchInfo
from batchgen.sampling.sampling_params import SamplingParams


def test_token_noise_is_standard_exponential_across_tokens_seeds_steps_and_streams() -> None:
    ids = torch.arange(4096, dtype=torch.int64)
    zero = torch.zeros_like(ids)
    across_tokens = exponential_noise(token_noise_keys(zero[:1], zero[:1]), 4096)[0]
    across_seeds = exponential_noise(token_noise_keys(ids, zero), 3)[:, 2]
    across_negative_seeds = exponential_noise(token_noise_keys(-1 - ids, zero), 3)[:, 2]  # int64 seeds, as vLLM's
    across_steps = exponential_noise(token_noise_keys(zero + 2**40, ids), 1)[:, 0]
    for noise in (across_tokens, across_seeds, across_negative_seeds, across_steps):
        assert kstest(noise.numpy(), "expon").pvalue > 1e-3
    # A negative seed is its own seed: none of -1..-4096 shares its row keys with one of 0..4095.
    positive, negative = token_noise_keys(ids, zero), token_noise_keys(-1 - ids, zero)
    assert not set(map(tuple, positive.tolist())) & set(map(tuple, negative.tolist()))
    # Streams give unrelated noise for the same (seed, step): their correlation is that of independent draws.
    streams = [
        exponential_noise(token_noise_keys(ids[:64], zero[:64], s), 64).flatten() for s in (DRAW, ACCEPT, RESIDUAL)
    ]
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert abs(float(torch.corrcoef(torch.stack([streams[a], streams[b]]))[0, 1])) < 4 / 4096**0.5


def test_a_rounding_sized_change_of_the_logits_rarely_changes_the_draw() -> None:
    """Gumbel-max picks argmax(l_i + G_i); moving every logit by at most ε changes the pick only when the best two
    scores are within 2ε. P(winner i and gap > t) = p_i e^-t / (1 - p_i (1 - e^-t)) ≥ p_i e^-t, so a flip has
    probability at most 1 - e^(-2ε) < 2ε: for ε = 1e-3 over 4,000 rows, about 8 flips at most on average.
    Inverse-CDF sampling shifts a token's interval by the perturbation summed over the whole vocabulary."""
    rows, vocab, eps = 4000, 49152, 1e-3
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, vocab, generator=gen).expand(rows, vocab) * 2.5  # a spread like a real model's
    perturbed = logits + (torch.rand(rows, vocab, generator=gen) * 2 - 1) * eps
    info = SamplingBatchInfo.from_params(
        [SamplingParams(temperature=1.0)] * rows,
        seeds=list(range(rows)),
        steps=[4] * rows,
        banned=[[]] * rows,
        vocab_size=vocab,
        device=torch.device("cpu"),
    )
    a = sample(logits.contiguous(), info).next_token_ids
    b = sample(perturbed, info).next_token_ids
    flips = int((a != b).sum())
    # Bound 8 on average; 8 + 4 standard deviations of a Poisson(8) count.
    assert flips <= 8 + 4 * 8**0.5, flips
    assert len(set(a.tolist())) > 1000  # the rows did draw from a wide distribution, not one likely token
