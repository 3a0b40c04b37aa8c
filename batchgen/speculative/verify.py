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

For a draft *model* with its own distribution ``q`` the rule stays the same; the draft model couples its draws
to the target's instead (``draft_model.py``): draft ``j + 1`` is drawn by the same sampler with the same
parameters, seed and output step as the target's draw at verify position ``j``, i.e. by inverse CDF with the same
uniform ``u``. A draft is then accepted exactly when ``F_q⁻¹(u) = F_p⁻¹(u)``: always when the two processed
distributions agree, and for greedy rows whenever the argmaxes do. Any coupling of ``p`` and ``q`` accepts with
probability at most ``Σ min(p, q)`` (one minus their total variation), which Leviathan et al.'s ``min(1, p/q)``
acceptance attains; this one can fall below it (most when ``q`` moves probability between tokens far apart in
vocabulary order, which shifts the CDF interval of every token in between). We pay that because it keeps every
emitted token the target's own seeded draw, so outputs stay bit-identical to plain decoding with the same seeds;
the optimal rule's resampling from ``norm(max(p − q, 0))`` would give other (equally distributed) tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from batchgen.loop.req import Req
from batchgen.sampling.grammar import GrammarState


class Drafter(Protocol):
    """Proposes draft tokens for decoding requests (n-gram lookup, a draft model…).

    The scheduler calls :meth:`propose_batch` once per decode round (through :func:`plan_drafts`),
    :meth:`on_verified` for every decoding request after the round's tokens are appended, and :meth:`release`
    when a request leaves the running set (finished or retracted). A drafter keeps its per-request state in
    ``req.draft_state``.
    """

    num_draft_tokens: int

    def propose_batch(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[list[int]]:
        """For each request, at most ``limits[i]`` tokens likely to follow its prompt + output (``[]`` for a
        limit of 0)."""
        ...

    def on_verified(self, req: Req) -> None:
        """The round's tokens are appended to ``req.output_ids``: forget (and free) what was built on drafts
        that were not accepted."""
        ...

    def release(self, req: Req) -> None:
        """``req`` finished or was retracted: free whatever the drafter holds for it."""
        ...


class PerRequestDrafter:
    """Base of drafters that look at one request at a time and hold no resources (n-gram lookup, tests)."""

    num_draft_tokens: int

    def propose(self, req: Req, limit: int) -> list[int]:
        """At most ``limit`` (≥ 1) tokens likely to follow ``req``'s prompt + output."""
        raise NotImplementedError

    def propose_batch(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[list[int]]:
        return [self.propose(req, limit) if limit > 0 else [] for req, limit in zip(reqs, limits)]

    def on_verified(self, req: Req) -> None:
        return None  # nothing depends on the drafts once they are verified

    def release(self, req: Req) -> None:
        return None  # nothing to free; any state in req.draft_state stays valid for the request's tokens


def plan_drafts(decodes: Sequence[Req], drafter: Drafter, room: int) -> list[int]:
    """Set every request's ``draft_ids`` (and ``draft_grammars``) for this round; return the tokens each
    processes (``1 + drafts``).

    Drafts stop at ``max_new_tokens`` and at the context length (so every verified position has a KV slot and an
    output step), within ``room`` free KV slots in all (a request's whole limit is reserved before drafting,
    since the drafter proposes for all requests at once), and before the first token the request's grammar
    rejects: the target cannot sample it there, so nothing after it could be accepted.
    """
    limits = []
    for req in decodes:
        limit = max(
            0,
            min(
                drafter.num_draft_tokens,
                req.params.max_new_tokens - len(req.output_ids) - 1,
                req.max_total_len - req.fill_len,
                room,
            ),
        )
        limits.append(limit)
        room -= limit
    lens = []
    for req, limit, proposed in zip(decodes, limits, drafter.propose_batch(decodes, limits)):
        drafts = proposed[:limit]
        grammars: list[GrammarState | None] = [req.grammar]
        if req.grammar is not None:
            state = req.grammar
            for count, token_id in enumerate(drafts):
                state = state.fork()
                if not state.accept(token_id):
                    drafts = drafts[:count]
                    break
                if state.terminated:
                    # This draft ends the request if accepted, so the draw after it is never emitted; a finished
                    # matcher has no next-token mask (xgrammar raises), so that position samples unconstrained.
                    drafts = drafts[: count + 1]
                    grammars.append(None)
                    break
                grammars.append(state)
        else:
            grammars *= 1 + len(drafts)
        req.draft_ids, req.draft_grammars = drafts, grammars
        lens.append(1 + len(drafts))
    return lens


def accepted_length(target_ids: Sequence[int], draft_ids: Sequence[int]) -> int:
    """How many of ``target_ids`` (the draws at the ``len(draft_ids) + 1`` verified positions) to emit: the
    drafts up to the first the target's draw differs from, plus that draw (or the bonus draw after the last)."""
    accepted = 0
    while accepted < len(draft_ids) and target_ids[accepted] == draft_ids[accepted]:
        accepted += 1
    return accepted + 1
