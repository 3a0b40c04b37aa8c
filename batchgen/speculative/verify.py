"""Speculative decoding inside the loop: choosing each round's drafts and deciding how many to accept.

A TARGET_VERIFY round feeds each request its pending token followed by its drafts ``d_1..d_k`` and samples the
target at all ``k + 1`` positions, position ``j`` with the inputs (seed, output step ``len(output) + j``,
penalty history, grammar state) plain decoding would use there if ``d_1..d_j`` had been sampled. Position ``j``
emits a token if every draft before it was accepted: ``d_{j+1}`` itself when accepted, otherwise a replacement
(or, after the last draft, the bonus draw), and :func:`accepted_length` counts them. Two rules decide, both of
which emit exactly the target's distribution:

- **coupled** (n-gram drafts always; draft models with ``--speculative-acceptance coupled``): every position's
  token is the target's plain draw with that step's uniform, and a draft is accepted when it equals it. Outputs
  are then the ones plain decoding gives with the same seeds (bit for bit up to the logits' batch-shape
  rounding). For a one-hot proposal (n-gram) this is rejection sampling: the draft is accepted with probability
  ``p(d) = min(1, p(d) / 1)`` and a rejection follows ``p`` conditioned on ``≠ d``, i.e.
  ``norm(max(p − onehot(d), 0))``. A draft model then draws its drafts with the target's uniforms
  (``draft_steps.py``), so a draft is accepted when ``F_q⁻¹(u) = F_p⁻¹(u)``: always when the processed
  distributions agree, but in general less often than ``Σ min(p, q)``.
- **rejection** (draft models' sampled rows, the default): Leviathan et al. 2023 / Chen et al. 2023, accept
  with ``min(1, p(d) / q(d))`` and redraw a rejection from ``norm(max(p − q, 0))``
  (:func:`batchgen.sampling.rejection.rejection_sample`), with uniforms of their own from (seed, step). It
  accepts with probability ``Σ min(p, q)``, the most any rule can; a seeded row's tokens then depend on which
  steps were verified as drafts, so they differ from plain decoding's and between runs whose draft budgets
  differ.

Greedy rows accept while the draft equals the target's argmax under either rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from batchgen.loop.req import Req
from batchgen.sampling.grammar import GrammarState
from batchgen.speculative.draft_budget import drafts_worth_verifying, fade_held_back


class Drafter(Protocol):
    """Proposes draft tokens for decoding requests (n-gram lookup, a draft model…).

    The scheduler calls :meth:`propose_batch` once per decode round (through :func:`plan_drafts`),
    :meth:`on_verified` for every decoding request after the round's tokens are appended, and :meth:`release`
    when a request leaves the running set (finished or retracted). A drafter keeps its per-request state in
    ``req.draft_state``; one that samples its drafts for rejection sampling sets ``req.draft_probs`` (the
    distribution of each proposed draft) in :meth:`propose_batch`.
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
            limit = drafts_worth_verifying(req, break_even, max(0, min(limit, useful)))
            fade_held_back(req, limit)
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
        if req.draft_probs is not None:
            req.draft_probs = req.draft_probs[: req.draft_proposed]
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
