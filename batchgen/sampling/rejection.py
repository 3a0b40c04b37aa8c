"""Speculative rejection sampling: verify a draft model's sampled drafts against the target's distribution.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding", Algorithm 1) and Chen et al.
2023 ("Accelerating Large Language Model Decoding with Speculative Sampling", Algorithm 2): a draft ``d`` drawn
from the draft model's distribution ``q`` is accepted with probability ``min(1, p(d) / q(d))``, ``p`` the
target's; a rejected draft is replaced by a draw from ``norm(max(p − q, 0))``. The emitted token then follows
``p`` exactly, and a draft is accepted with probability ``Σ min(p, q)``, the most any rule that emits ``p`` can.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.sampling.random import ACCEPT, RESIDUAL, exponential_race, token_noise_keys, uniform_from_counter


@dataclass
class DraftProposals:
    """The drafts of one verify round that are checked by rejection sampling (sampled rows of draft models).

    Attributes:
        rows: int64 ``[m]``, the batch rows (verify positions) whose draw decides a draft.
        token_ids: int64 ``[m]``, the draft at each of those positions.
        probs: float32 ``[m, vocab]``, the distribution ``q`` each draft was drawn from (the draft model's
            logits processed with the row's own parameters; one-hot for a draft that was not sampled, such as
            the graph runner's padding).
    """

    rows: torch.Tensor
    token_ids: torch.Tensor
    probs: torch.Tensor


def rejection_sample(
    drawn: torch.Tensor,
    probs: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    drafts: DraftProposals,
    cpu_kernel: bool = True,
) -> torch.Tensor:
    """The token each row emits if reached: its draft if accepted, else a draw from the residual.

    Args:
        drawn: int64 ``[n]``, every row's plain draw from ``p`` (kept for rows without a draft).
        probs: float32 ``[n, vocab]``, each row's processed target distribution ``p`` (normalised).
        seeds, steps: int64 ``[n]``, each row's seed and output step; the accept test (a uniform of
            :func:`uniform_from_counter`) and the residual draw (an exponential race) use their own streams,
            independent of the draft's draw.
        drafts: the rows to verify, their drafts and the draft distributions ``q``.
        cpu_kernel: the race may run batchgen's C++ op.

    Returns:
        int64 ``[n]``. A rejected row's token is never its draft (``p(d) < q(d)`` there, so the residual has no
        mass on it), so the caller finds the accepted run by comparing tokens with drafts.
    """
    rows = drafts.rows
    if not rows.numel():
        return drawn
    p = probs[rows]
    q = drafts.probs
    token_ids = drafts.token_ids[:, None]
    p_draft, q_draft = p.gather(1, token_ids).squeeze(1), q.gather(1, token_ids).squeeze(1)
    seeds, steps = seeds[rows], steps[rows]
    accepted = uniform_from_counter(seeds, steps, ACCEPT) * q_draft.double() <= p_draft.double()
    excess = (p - q).clamp_(min=0.0)
    residual = exponential_race(excess, token_noise_keys(seeds, steps, RESIDUAL), cpu_kernel)
    # No residual mass means p = q up to rounding, where rejection has probability ~0: the plain draw is p's.
    replacement = torch.where((excess > 0).any(dim=1), residual, drawn[rows])
    out = drawn.clone()
    out[rows] = torch.where(accepted, drafts.token_ids, replacement)
    return out
