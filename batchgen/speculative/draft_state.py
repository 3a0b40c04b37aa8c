"""``DraftState``: what speculative decoding keeps for one request, hung on ``req.draft_state``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchgen.loop.req import Req


@dataclass
class DraftState:
    """One request's speculative bookkeeping, for its whole life (kept when it is retracted).

    Attributes:
        proposer: the drafter's own state (an n-gram index, a draft-model row), ``None`` until it drafts.
        position_tries, position_hits: per draft position, the verify rounds that tried it (all drafts before it
            accepted) and that accepted it, faded while the position is held back (``draft_budget``).
        rounds, tokens: verify rounds with proposed drafts, and the tokens they emitted.
    """

    proposer: Any = None
    position_tries: list[float] = field(default_factory=list)
    position_hits: list[float] = field(default_factory=list)
    rounds: int = 0
    tokens: int = 0

    @staticmethod
    def of(req: Req) -> DraftState:
        """``req``'s state, made empty on first use."""
        if req.draft_state is None:
            req.draft_state = DraftState()
        state: DraftState = req.draft_state
        return state


def spec_accept_length(req: Req) -> float | None:
    """Tokens per verify round with proposed drafts (the output column ``spec_accept_length``); ``None`` for a
    request that had none."""
    state: DraftState | None = req.draft_state
    return state.tokens / state.rounds if state is not None and state.rounds else None
