"""What the scheduler asks of speculative decoding: the ``Drafter`` protocol (``batchgen.speculative`` implements
it), a request's drafts for one TARGET_VERIFY round, and the rule that counts how many tokens such a round emits.

The loop never imports ``batchgen.speculative``: whoever builds the ``Engine`` passes the drafter's factory.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from batchgen.loop.req import Req
from batchgen.sampling.grammar import GrammarState
from batchgen.sampling.penalties import TokenHistory


@dataclass
class RoundDrafts:
    """One request's drafts in a TARGET_VERIFY round.

    The round feeds the request's pending token followed by ``ids`` and samples at every one of those
    ``len(ids) + 1`` positions, position ``j`` as if drafts ``1..j`` had been sampled.

    Attributes:
        ids: the drafts to verify: the first ``proposed`` from the drafter, the rest padding for the graph
            runner's fixed shape.
        grammars: the grammar state at each of the ``len(ids) + 1`` positions (index ``j``: after ``j`` drafts;
            0 is ``req.grammar`` itself; ``None`` unconstrained).
        proposed: how many of ``ids`` the drafter proposed.
        probs: float32 ``[proposed, vocab]``, the distributions a draft model drew its proposed drafts from, for
            rejection sampling (sampled rows; ``None`` otherwise).
    """

    ids: list[int]
    grammars: list[GrammarState | None]
    proposed: int
    probs: torch.Tensor | None = None

    def history_after(self, history: TokenHistory | None, count: int) -> TokenHistory | None:
        """The penalty history ``history`` as if the first ``count`` drafts had been sampled (itself for 0)."""
        if history is None or count == 0:
            return history
        after = TokenHistory(history.prompt_tokens, Counter(history.output_counts))
        for token_id in self.ids[:count]:
            after.add(token_id)
        return after


class Drafter(Protocol):
    """Proposes draft tokens for decoding requests (n-gram lookup, a draft model…).

    The scheduler calls :meth:`plan` once per decode round, :meth:`on_verified` for every decoding request after
    the round's tokens are appended, and :meth:`release` when a request leaves the running set (finished or
    retracted). A drafter keeps its per-request state in ``req.draft_state``.
    """

    def plan(self, decodes: Sequence[Req], room: int, pad: bool, break_even: float) -> list[RoundDrafts]:
        """Each of ``decodes``' drafts for this round, within ``room`` free KV slots in all.

        ``pad``: the graph runner's fixed verify shape (every request verifies K drafts, padded when fewer);
        ``break_even``: the acceptance probability below which a draft costs more than it saves.
        """
        ...

    def on_verified(self, req: Req, drafts: RoundDrafts | None, accepted: int, emitted: int) -> None:
        """The round's ``emitted`` tokens are appended to ``req.output_ids``; the target agreed with the first
        ``accepted`` of ``drafts`` (``None``: a DECODE round). Record the acceptance and forget (and free)
        what was built on drafts that were not accepted."""
        ...

    def release(self, req: Req) -> None:
        """``req`` finished or was retracted: free whatever the drafter holds for it."""
        ...


def accepted_length(target_ids: Sequence[int], draft_ids: Sequence[int]) -> int:
    """How many of ``target_ids`` (the draws at the ``len(draft_ids) + 1`` verified positions) to emit: the
    drafts up to the first the target's draw differs from, plus that draw (or the bonus draw after the last)."""
    accepted = 0
    while accepted < len(draft_ids) and target_ids[accepted] == draft_ids[accepted]:
        accepted += 1
    return accepted + 1
