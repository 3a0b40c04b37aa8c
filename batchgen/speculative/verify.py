"""Speculative decoding inside the loop: choosing each round's drafts and deciding how many to accept.

A TARGET_VERIFY round feeds each request its pending token followed by its drafts ``d_1..d_k`` and samples the
target at all ``k + 1`` positions, position ``j`` with the noise of output step ``len(output) + j`` — exactly
the draw plain decoding would make there if ``d_1..d_j`` had been sampled. Drafts are accepted while they equal
those draws; the first draw that differs (or the bonus draw after ``d_k``) is emitted too. Every emitted token is
therefore the target's own sample given the tokens before it, so the output is the one plain decoding gives with
the same seeds (bit for bit up to the logits' batch-shape rounding), greedy or sampled.

For a draft that is a single token (n-gram drafting, whose proposal distribution is one-hot) this is rejection
sampling (Leviathan et al. 2023, Chen et al. 2023) with a particular coupling of the random numbers: the draft
is accepted with probability ``p(d)`` = ``min(1, p(d) / 1)``, and on rejection the emitted token follows ``p``
conditioned on ``≠ d``, i.e. ``norm(max(p − onehot(d), 0))``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from batchgen.loop.req import Req
from batchgen.sampling.grammar import GrammarState


class Drafter(Protocol):
    """Proposes draft tokens for a decoding request (n-gram lookup, a draft model…)."""

    num_draft_tokens: int

    def propose(self, req: Req, limit: int) -> list[int]:
        """At most ``limit`` tokens likely to follow ``req``'s prompt + output."""
        ...


def plan_drafts(decodes: Sequence[Req], drafter: Drafter, room: int) -> list[int]:
    """Set every request's ``draft_ids`` (and ``draft_grammars``) for this round; return the tokens each
    processes (``1 + drafts``).

    Drafts stop at ``max_new_tokens`` and at the context length (so every verified position has a KV slot and an
    output step), within ``room`` free KV slots in all, and before the first token the request's grammar rejects:
    the target cannot sample it there, so nothing after it could be accepted.
    """
    lens = []
    for req in decodes:
        limit = min(
            drafter.num_draft_tokens,
            req.params.max_new_tokens - len(req.output_ids) - 1,
            req.max_total_len - req.fill_len,
            room,
        )
        drafts = drafter.propose(req, limit) if limit > 0 else []
        grammars: list[GrammarState | None] = [req.grammar]
        if req.grammar is not None:
            state = req.grammar
            for count, token_id in enumerate(drafts):
                state = state.fork()
                if not state.accept(token_id):
                    drafts = drafts[:count]
                    break
                grammars.append(state)
        else:
            grammars *= 1 + len(drafts)
        req.draft_ids, req.draft_grammars = drafts, grammars
        room -= len(drafts)
        lens.append(1 + len(drafts))
    return lens


def accepted_length(target_ids: Sequence[int], draft_ids: Sequence[int]) -> int:
    """How many of ``target_ids`` (the draws at the ``len(draft_ids) + 1`` verified positions) to emit: the
    drafts up to the first the target's draw differs from, plus that draw (or the bonus draw after the last)."""
    accepted = 0
    while accepted < len(draft_ids) and target_ids[accepted] == draft_ids[accepted]:
        accepted += 1
    return accepted + 1
