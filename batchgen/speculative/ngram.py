"""N-gram drafting: propose the tokens that followed the last occurrence of the sequence's own suffix.

Prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` and SGLang's ``NGRAM`` speculative algorithms): text that
quotes or repeats itself (code edits, extraction, summaries, loops) continues the way it did before, so the
tokens after an earlier occurrence of the last ``m`` tokens are good guesses, and cost no model call.
"""

from __future__ import annotations

from collections.abc import Sequence

from batchgen.loop.req import Req
from batchgen.speculative.draft_state import DraftState
from batchgen.speculative.verify import PerRequestDrafter


class NgramIndex:
    """Where each n-gram (``min_n ≤ n ≤ max_n`` tokens) of one sequence last occurred, kept up to date as it grows.

    Maps an n-gram to the index just after its most recent occurrence that is followed by at least one token,
    so the sequence's own suffix never matches itself. Indexing is incremental: each call looks only at the
    tokens added since the last one.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._next_after: dict[tuple[int, ...], int] = {}
        self._indexed = 0

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix.

        ``tokens`` is the whole sequence so far (prompt + output), which only ever grows between calls.
        Returns ``[]`` when no suffix of ``min_n``..``max_n`` tokens occurred before.
        """
        length = len(tokens)
        for end in range(max(self._indexed, 1), length):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._next_after[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, length)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            start = self._next_after.get(tuple(tokens[length - n :]))
            if start is not None:
                return list(tokens[start : start + k])
        return []


class NgramDrafter(PerRequestDrafter):
    """Drafts up to ``num_draft_tokens`` per round by n-gram lookup over each request's prompt and output.

    Keeps one :class:`NgramIndex` per request in its :class:`DraftState`, so a round costs only the new tokens.
    """

    def __init__(self, num_draft_tokens: int, min_n: int, max_n: int) -> None:
        self.num_draft_tokens = num_draft_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, req: Req, limit: int) -> list[int]:
        """Up to ``limit`` drafts (the scheduler's draft budget already trimmed ``limit`` to what this request's
        acceptance record makes worth verifying)."""
        state = DraftState.of(req)
        if state.proposer is None:
            state.proposer = NgramIndex(self.min_n, self.max_n)
        index: NgramIndex = state.proposer
        return index.propose(req.prompt_ids + req.output_ids, limit)
