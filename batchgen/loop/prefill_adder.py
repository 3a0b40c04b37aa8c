"""``PrefillAdder``: which prefill chunks join a round (SGLang's ``PrefillAdder``, in its ``schedule_policy.py``).

Partly prefilled requests go first, then waiting requests are admitted in the ``WaitingQueue``'s order while
there is a free request row, prefill token budget and KV room. An admitted request first takes the longest
cached prefix of its tokens from the prefix cache (``KVCache.match``) and prefills only the rest.

KV room: a request is admitted only if its pending tokens fit beside the room kept for the running requests'
decodes. For requests that may stop early that room is SGLang's estimate (``new_token_ratio`` of their remaining
tokens), and when it proves short the scheduler retracts the newest request. For requests that always run to their
length (``ignore_eos`` and no stop ids, strings or grammar: benchmarks, fixed-length generation) it is what their
growth will need, so a job of only such rows is never retracted and computes no token twice. Under speculative
decoding, where a round adds a varying number of tokens, every request takes the estimate.

In-batch prefix sharing: a waiting request whose prompt shares at least ``SHARED_PREFIX_MIN`` more tokens with
a request still prefilling than the cache holds waits for that request to finish its prefill (its K/V then
joins the cache) instead of computing the same prefix beside it (SGLang's in-batch prefix caching).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from batchgen.loop.kv_cache import KVCache
from batchgen.loop.radix_cache import PrefixMatcher
from batchgen.loop.req import Req
from batchgen.loop.waiting_queue import WaitingQueue

# A shared prefix shorter than this is not worth a round's wait (SGLang's in-batch threshold is 32 tokens too).
SHARED_PREFIX_MIN = 32


class PrefillAdder:
    """Builds one round's prefill rows (``reqs``, each taking ``lens`` tokens); of the requests it admits for the
    first time (not retracted ones coming back), counts the prompt tokens (``admitted_prompt_tokens``) and those
    the prefix cache gave them (``cached_tokens``).

    Args:
        kv_cache: the target model's rows, slots and prefix cache.
        running: the running requests; admitted ones are appended to it.
        waiting: the waiting requests; admitted ones are removed from it.
        max_running_requests: requests holding KV at once (an ``n > 1`` request counts ``n`` times).
        budget: prompt tokens this round may prefill; chunk: longest chunk per request, 0 for whole prompts.
        reserved: KV slots already promised to this round's decodes.
        new_token_ratio: see ``SchedulerOptions``.
        exact_growth: keep exact room for requests that always run to their length (one token a round: not under
            speculative decoding).
    """

    def __init__(
        self,
        kv_cache: KVCache,
        running: list[Req],
        waiting: WaitingQueue,
        max_running_requests: int,
        budget: int,
        chunk: int,
        reserved: int,
        new_token_ratio: float,
        exact_growth: bool,
    ) -> None:
        self.kv_cache = kv_cache
        self.running = running
        self.waiting = waiting
        self.max_running_requests = max_running_requests
        self.budget = budget
        self.chunk = chunk
        self.used = reserved  # slots promised this round (decodes, and whole pending tokens of each prefill)
        self.new_token_ratio = new_token_ratio
        self.exact_growth = exact_growth
        self.reqs: list[Req] = []
        self.lens: list[int] = []
        self.cached_tokens = 0
        self.admitted_prompt_tokens = 0

    def add_chunked(self) -> None:
        """Continue the running requests' unfinished prefills.

        KV room is checked for a request's *whole* pending tokens: chunking splits a prompt's compute over
        rounds, not its memory (as SGLang's admission does). A partly prefilled request whose rest does not fit
        waits for decodes to finish or to retract something; splitting it by the room left would let it be
        retracted again and again, one token short, while the decodes that block it never run.
        """
        for req in self.running:
            if not req.is_decoding and self.budget > 0 and req.num_pending <= self.kv_cache.available() - self.used:
                self._take(req, min(req.num_pending, self.budget))

    def add_waiting(self) -> None:
        """Admit waiting requests in the queue's order until one does not fit (an ``n > 1`` request reserves a
        request row, and a place among the running, for each sample)."""
        if self.budget <= 0 or not len(self.waiting) or not self._rows_free(1):
            return
        if self.kv_cache.radix_cache is None:
            candidates = [(req, 0) for req in self.waiting.in_order()]
        else:
            candidates = self.waiting.by_cached_match(PrefixMatcher(self.kv_cache.radix_cache))
        prefilling = [r for r in self.running if not r.is_decoding]
        for req, match in candidates:
            if self.budget <= 0:
                break
            rows = 1 + req.unforked_samples
            if not self._rows_free(rows):
                break
            if prefilling and _waits_for_shared_prefix(req, min(match, req.match_limit), prefilling):
                continue
            if not self._admit(req, rows):
                break
            prefilling.append(req)

    def _admit(self, req: Req, rows: int) -> bool:
        """Give ``req`` its request rows and its cached prefix, and take its first chunk, if its pending tokens
        fit; else undo and return False."""
        pool_rows = self.kv_cache.allocate_rows(rows)
        req.req_pool_idx, req.fork_rows = pool_rows[0], pool_rows[1:]
        req.kv_len = self.kv_cache.match(pool_rows[0], req.fill_ids(req.match_limit))
        need = req.num_pending
        room = self.kv_cache.available() - self.used
        # Keep room for the decodes of everything already running and of this request, unless it would run
        # alone: then it must be admitted for the job to make progress.
        free = room - self._decode_reserve([*self.running, req]) if self.running else room
        # Whole prompts only without chunking; one longer than the budget gets a round of its own.
        whole_too_long = self.chunk == 0 and need > self.budget and bool(self.reqs)
        if need > free or whole_too_long:
            for row, length in zip(pool_rows, [req.kv_len, *[0] * (rows - 1)]):
                self.kv_cache.release(row, length)
            req.req_pool_idx, req.fork_rows, req.kv_len = None, [], 0
            return False
        came_back = self.waiting.remove(req)
        self.running.append(req)
        if not came_back:
            self.cached_tokens += req.kv_len
            self.admitted_prompt_tokens += len(req.prompt_ids)
        self._take(req, need if self.chunk == 0 else min(need, self.budget))
        return True

    def _take(self, req: Req, n: int) -> None:
        self.reqs.append(req)
        self.lens.append(n)
        self.budget -= n
        self.used += req.num_pending

    def _rows_free(self, rows: int) -> bool:
        return len(self.running) + rows <= self.max_running_requests and self.kv_cache.available_rows() >= rows

    def _decode_reserve(self, reqs: list[Req]) -> int:
        """KV slots to keep free for the decodes of ``reqs`` beyond this round's (already in ``used``). A request
        that may stop early (EOS, stop ids or strings, a grammar) is expected to use ``new_token_ratio`` of its
        remaining tokens (SGLang's estimate). One that always runs to its length (``ignore_eos`` and nothing else
        stops it) takes exactly its remaining tokens, one a round, and a decoding one then gives back those and
        the slots no other request holds: together they need the peak of :func:`peak_growth`."""
        estimated = 0
        certain: list[tuple[int, int]] = []
        decoding = 0
        for r in reqs:
            remaining = r.remaining_tokens
            if not (self.exact_growth and r.runs_to_length):
                estimated += remaining * (1 + r.unforked_samples)
                continue
            # Counted as freeing nothing: one still prefilling (its decoding, so its end, may start rounds later)
            # and the samples of an n > 1 row (their prompt goes with the last one).
            freed = 0
            if r.is_decoding and r.params.n == 1:
                assert r.req_pool_idx is not None
                freed = remaining + r.kv_len - self.kv_cache.shared_len(r.req_pool_idx)
                decoding += 1
            certain.extend([(remaining, freed)] + [(remaining, 0)] * r.unforked_samples)
        # A decoding request's slot of this round is in `used` already.
        return math.ceil(estimated * self.new_token_ratio) + max(0, peak_growth(certain) - decoding)


def _waits_for_shared_prefix(req: Req, cached: int, prefilling: Sequence[Req]) -> bool:
    """Whether ``req``'s prompt shares ``SHARED_PREFIX_MIN`` tokens past its ``cached`` ones with the prompt of
    a request still prefilling."""
    want = cached + SHARED_PREFIX_MIN
    if len(req.prompt_ids) <= want:
        return False
    head = req.prompt_ids[:want]
    return any(p.prompt_ids[:want] == head for p in prefilling)


def peak_growth(requests: Sequence[tuple[int, int]]) -> int:
    """The most KV slots that requests taking one slot a round need beyond what they hold now, given for each
    ``(a, freed)``: it takes ``a`` more slots, then finishes and gives back ``freed`` slots (its ``a`` and those
    only it held; 0 for one assumed to keep everything). After ``t`` rounds that is
    ``t * #{a >= t} + sum of (a - freed) over a < t``; its maximum over ``t >= 0`` is returned.

    Between finishes the sum only grows, so the maximum is at one of the ``a``: one pass over them sorted. E.g.
    ``[(2, 12), (5, 15)]``: 2 after 1 round, 4 after 2; then the first gives back 12 and the sum stays below 4.
    """
    peak = after = 0  # after: the sum of a - freed over those finished before the current a
    ordered = sorted(requests)
    for i, (a, freed) in enumerate(ordered):
        peak = max(peak, a * (len(ordered) - i) + after)
        after += a - freed
    return peak
