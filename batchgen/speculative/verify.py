"""Speculative decoding: choosing each round's drafts (the base of the drafters), and how many the target accepts.

A TARGET_VERIFY round feeds each request its pending token followed by its drafts ``d_1..d_k`` and samples the
target at all ``k + 1`` positions, position ``j`` with the inputs (seed, output step ``len(output) + j``,
penalty history, grammar state) plain decoding would use there if ``d_1..d_j`` had been sampled. Position ``j``
emits a token if every draft before it was accepted: ``d_{j+1}`` itself when accepted, otherwise a replacement
(or, after the last draft, the bonus draw), and :func:`batchgen.loop.drafter.accepted_length` counts them. Two
rules decide, both of which emit exactly the target's distribution:

- **coupled** (n-gram drafts always; draft models with ``--speculative-acceptance coupled``): every position's
  token is the target's plain draw with that step's noise, and a draft is accepted when it equals it. Outputs
  are then the ones plain decoding gives with the same seeds (bit for bit up to the logits' batch-shape
  rounding). For a one-hot proposal (n-gram) this is rejection sampling: the draft is accepted with probability
  ``p(d) = min(1, p(d) / 1)`` and a rejection follows ``p`` conditioned on ``≠ d``, i.e.
  ``norm(max(p − onehot(d), 0))``. A draft model then draws its drafts with the target's noise
  (``draft_steps.py``), so a draft is accepted when the exponential races over ``q`` and over ``p`` with the same
  noise pick the same token (Gumbel coupling): always when the processed distributions agree, with probability
  at least ``Σ min(p, q) / (2 − Σ min(p, q))`` in general, less than rejection sampling's ``Σ min(p, q)``.
- **rejection** (draft models' sampled rows, the default): Leviathan et al. 2023 / Chen et al. 2023, accept
  with ``min(1, p(d) / q(d))`` and redraw a rejection from ``norm(max(p − q, 0))``
  (:func:`batchgen.sampling.rejection.rejection_sample`), with noise of their own from (seed, step). It
  accepts with probability ``Σ min(p, q)``, the most any rule can; a seeded row's tokens then depend on which
  steps were verified as drafts, so they differ from plain decoding's and between runs whose draft budgets
  differ.

Greedy rows accept while the draft equals the target's argmax under either rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchgen.loop.drafter import RoundDrafts
from batchgen.loop.req import Req
from batchgen.sampling.grammar import GrammarState
from batchgen.speculative.draft_budget import drafts_worth_verifying, fade_held_back, record_acceptance
from batchgen.speculative.draft_state import DraftState

# A drafter's proposal for one request: its draft tokens, and the float32 ``[len, vocab]`` distributions they were
# drawn from when they are to be verified by rejection sampling (``None`` otherwise).
Proposal = tuple[list[int], torch.Tensor | None]


class SpeculativeDrafter:
    """Base of the drafters: implements ``batchgen.loop.drafter.Drafter`` around :meth:`propose_batch`.

    :meth:`plan` sizes each request's drafts with its draft budget (:func:`plan_drafts`); :meth:`on_verified`
    records the acceptance in the request's :class:`DraftState` and calls :meth:`forget_rejected`. Subclasses
    propose, and free what they built on drafts that were not accepted.
    """

    num_draft_tokens: int

    def propose_batch(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[Proposal]:
        """For each request, at most ``limits[i]`` tokens likely to follow its prompt + output (``[]`` for a
        limit of 0)."""
        raise NotImplementedError

    def forget_rejected(self, req: Req) -> None:
        """The round's tokens are appended to ``req.output_ids``: forget (and free) what was built on drafts
        that were not accepted."""
        return None

    def release(self, req: Req) -> None:
        """``req`` finished or was retracted: free whatever the drafter holds for it."""
        return None

    def plan(self, decodes: Sequence[Req], room: int, pad: bool, break_even: float) -> list[RoundDrafts]:
        """The round's drafts of each of ``decodes`` (the loop's ``Drafter.plan``): :func:`plan_drafts`."""
        return plan_drafts(decodes, self, room, pad=pad, break_even=break_even)

    def on_verified(self, req: Req, drafts: RoundDrafts | None, accepted: int, emitted: int) -> None:
        """After a verify round: record ``accepted`` of ``drafts``' proposed tokens and the ``emitted`` tokens in
        ``req``'s :class:`DraftState`, then forget what was built on the rejected ones."""
        # Only rounds that verified proposed drafts measure acceptance (as SGLang's verify count); a round of
        # padding drafts alone is not one.
        if drafts is not None and drafts.proposed:
            state = DraftState.of(req)
            record_acceptance(state, drafts.proposed, min(accepted, drafts.proposed))
            state.rounds += 1
            state.tokens += emitted
        self.forget_rejected(req)


class PerRequestDrafter(SpeculativeDrafter):
    """Base of drafters that look at one request at a time and hold no resources (n-gram lookup, tests)."""

    def propose(self, req: Req, limit: int) -> list[int]:
        """At most ``limit`` (≥ 1) tokens likely to follow ``req``'s prompt + output."""
        raise NotImplementedError

    def propose_batch(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[Proposal]:
        """Each request's :meth:`propose` (none where its limit is 0), without draft probabilities."""
        return [(self.propose(req, limit) if limit > 0 else [], None) for req, limit in zip(reqs, limits)]


def plan_drafts(
    decodes: Sequence[Req], drafter: SpeculativeDrafter, room: int, pad: bool = False, break_even: float = 0.0
) -> list[RoundDrafts]:
    """Every request's drafts for this round (each processes ``1 + len(ids)`` tokens).

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
    (:func:`batchgen.speculative.draft_budget.drafts_worth_verifying`); the record of those held back fades.
    """
    limits, asks = [], []
    for req in decodes:
        # Draws past max_new_tokens are never emitted, so drafting there is pointless; the fixed-shape (pad) mode
        # still fills those positions, which costs a KV slot each until the round ends, but keeps the round
        # uniform. The context length is a hard limit: a position past it has no req_to_token column.
        useful = req.params.max_new_tokens - len(req.output_ids) - 1
        limit = max(0, min(drafter.num_draft_tokens, req.max_total_len - req.fill_len, room))
        if not pad:
            state = DraftState.of(req)
            limit = drafts_worth_verifying(state, break_even, max(0, min(limit, useful)))
            fade_held_back(state, limit)
        limits.append(limit)
        asks.append(max(0, min(limit, useful)))
        room -= limit
    plans = []
    for req, limit, (proposed, probs) in zip(decodes, limits, drafter.propose_batch(decodes, asks)):
        drafts = proposed[:limit]
        count = len(drafts)
        if pad:
            drafts += [(drafts or req.pending_ids(1))[-1]] * (limit - len(drafts))
        # Draft j is output token len(output_ids) + j + 1, which may end the row from min_new_tokens on.
        ends_from = req.params.min_new_tokens - len(req.output_ids) - 1
        ids, grammars = _walk_grammar(req.grammar, drafts, keep_rejected=pad, ends_from=ends_from)
        count = min(count, len(ids))
        plans.append(RoundDrafts(ids, grammars, count, probs[:count] if probs is not None else None))
    return plans


def _walk_grammar(
    grammar: GrammarState | None, drafts: list[int], keep_rejected: bool, ends_from: int
) -> tuple[list[int], list[GrammarState | None]]:
    """The drafts to verify and the grammar state of each of their ``len + 1`` positions (``None``:
    unconstrained), position ``j`` being the state after drafts ``0..j-1``; a stop id ends the grammar only from
    draft ``ends_from`` on (``min_new_tokens``: before, it is text, as :func:`~batchgen.loop.stop_checker.append_token`
    takes it; found by a helper: an ending taken too early left the positions after it unconstrained)."""
    if grammar is None:
        return drafts, [None] * (1 + len(drafts))
    grammars: list[GrammarState | None] = [grammar]
    state = grammar
    for count, token_id in enumerate(drafts):
        state = state.fork()
        accepted = state.accept(token_id, may_end=count >= ends_from)
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
