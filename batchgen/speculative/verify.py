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
from batchgen.speculative.draft_budget import drafts_worth_verifying


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


def plan_drafts(
    decodes: Sequence[Req], drafter: Drafter, room: int, pad: bool = False, break_even: float = 0.0
) -> list[int]:
    """Set every request's ``draft_ids`` (and ``draft_grammars``, ``draft_proposed``) for this round; return the
    tokens each processes (``1 + drafts``).

    Drafts stop at ``max_new_tokens`` and at the context length (so every verified position has a KV slot and an
    output step), within ``room`` free KV slots in all (a request's whole limit is reserved before drafting,
    since the drafter proposes for all requests at once), and before the first token the request's grammar
    rejects: the target cannot sample it there, so nothing after it could be accepted.

    ``pad`` (the CUDA-graph runner's fixed verify shape): every request gets exactly K drafts unless the context
    length or ``room`` stops it (not ``max_new_tokens``): the drafter's proposal followed by copies of its last
    token (or of the pending token), and a token the grammar rejects is kept instead of cutting the list. Any
    draft is sound to verify: one is accepted only when it equals the target's own draw, and the position after a
    rejected or grammar-ending draft is never reached.

    Without ``pad``, a request is offered only the drafts worth verifying at ``break_even`` acceptance
    (:func:`batchgen.speculative.draft_budget.drafts_worth_verifying`).
    """
    limits, asks = [], []
    for req in decodes:
        # Draws past max_new_tokens are never emitted, so drafting there is pointless; the fixed-shape (pad) mode
        # still fills those positions, which costs a KV slot each until the round ends, but keeps the round
        # uniform. The context length is a hard limit: a position past it has no req_to_token column.
        useful = req.params.max_new_tokens - len(req.output_ids) - 1
        limit = max(0, min(drafter.num_draft_tokens, req.max_total_len - req.fill_len, room))
        if not pad:
            limit = drafts_worth_verifying(req, break_even, max(0, min(limit, useful)))
        limits.append(limit)
        asks.append(max(0, min(limit, useful)))
        room -= limit
    lens = []
    for req, limit, proposed in zip(decodes, limits, drafter.propose_batch(decodes, asks)):
        drafts = proposed[:limit]
        req.draft_proposed = len(drafts)
        if pad:
            drafts += [(drafts or req.pending_ids(1))[-1]] * (limit - len(drafts))
        req.draft_ids, req.draft_grammars = _walk_grammar(req.grammar, drafts, keep_rejected=pad)
        req.draft_proposed = min(req.draft_proposed, len(req.draft_ids))
        lens.append(1 + len(req.draft_ids))
    return lens


def _walk_grammar(
    grammar: GrammarState | None, drafts: list[int], keep_rejected: bool
) -> tuple[list[int], list[GrammarState | None]]:
    """The drafts to verify and the grammar state of each of their ``len + 1`` positions (``None``:
    unconstrained), position ``j`` being the state after drafts ``0..j-1``."""
    if grammar is None:
        return drafts, [None] * (1 + len(drafts))
    grammars: list[GrammarState | None] = [grammar]
    state = grammar
    for count, token_id in enumerate(drafts):
        state = state.fork()
        accepted = state.accept(token_id)
        if accepted and not state.terminated:
            grammars.append(state)
            continue
        if not accepted and not keep_rejected:
            return drafts[:count], grammars
        # This draft is rejected by the target (its draw is grammar-constrained), or, accepted, ends the request:
        # the draws after it are never emitted. A finished matcher has no next-token mask (xgrammar raises), so
        # those positions sample unconstrained.
        kept = drafts if keep_rejected else drafts[: count + 1]
        return kept, grammars + [None] * (len(kept) - count)
    return drafts, grammars


def accepted_length(target_ids: Sequence[int], draft_ids: Sequence[int]) -> int:
    """How many of ``target_ids`` (the draws at the ``len(draft_ids) + 1`` verified positions) to emit: the
    drafts up to the first the target's draw differs from, plus that draw (or the bonus draw after the last)."""
    accepted = 0
    while accepted < len(draft_ids) and target_ids[accepted] == draft_ids[accepted]:
        accepted += 1
    return accepted + 1
