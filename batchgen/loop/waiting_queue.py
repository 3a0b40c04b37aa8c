"""``WaitingQueue``: the requests read but not admitted, and the order the scheduler considers them in.

With a prefix cache the order is SGLang's ``lpm`` (longest prefix match) policy: the request whose prompt has
the longest cached prefix goes first, so a prefix is reused while it is in the pool instead of being evicted
and computed again. The queue keeps its requests sorted by prompt token ids, i.e. in the depth-first order of a
trie of the prompts: prompts that share a prefix sit side by side however the input interleaves them, ties of
the match length keep that order, and the tree walks that rank them resume where the predecessor's left off
(:meth:`WaitingQueue.by_cached_match`). Without a prefix cache requests wait
first come, first served. Retracted requests always come first, in the order they were retracted.
"""

from __future__ import annotations

import bisect
from collections import deque

from batchgen.loop.radix_cache import PrefixMatcher, common_prefix_len
from batchgen.loop.req import Req


class WaitingQueue:
    """Retracted requests (first come, first served), then new ones (in prompt order when ``by_prefix``).

    Args:
        by_prefix: keep new requests sorted by their prompt ids (a prefix cache is on); else in arrival order.
    """

    def __init__(self, by_prefix: bool) -> None:
        self.by_prefix = by_prefix
        self.retracted: deque[Req] = deque()
        self._reqs: list[Req] = []
        self._keys: list[list[int]] = []  # each request's prompt ids, when by_prefix
        self._lcp: list[int] = []  # _lcp[i]: tokens _keys[i] shares with _keys[i - 1] (0 for i = 0)

    def __len__(self) -> int:
        return len(self.retracted) + len(self._reqs)

    def append(self, req: Req) -> None:
        """A new request."""
        if not self.by_prefix:
            self._reqs.append(req)
            return
        key = req.prompt_ids
        i = bisect.bisect_right(self._keys, key)
        self._reqs.insert(i, req)
        self._keys.insert(i, key)
        self._lcp.insert(i, common_prefix_len(self._keys[i - 1], key) if i else 0)
        if i + 1 < len(self._keys):
            self._lcp[i + 1] = common_prefix_len(key, self._keys[i + 1])

    def appendleft(self, req: Req) -> None:
        """A retracted request: it goes before every new one and every request retracted earlier."""
        self.retracted.appendleft(req)

    def remove(self, req: Req) -> bool:
        """Take ``req`` out (it was admitted); return whether it had been retracted."""
        if any(r is req for r in self.retracted):
            self.retracted.remove(req)
            return True
        if not self.by_prefix:
            self._reqs.remove(req)
            return False
        i = bisect.bisect_left(self._keys, req.prompt_ids)
        while self._reqs[i] is not req:
            i += 1
        if i + 1 < len(self._keys):
            # In sorted order the common prefix of two keys is the smallest of those between them.
            self._lcp[i + 1] = min(self._lcp[i], self._lcp[i + 1]) if i else 0
        del self._reqs[i], self._keys[i], self._lcp[i]
        return False

    def in_order(self) -> list[Req]:
        """Every waiting request, retracted ones first, without ranking (no prefix cache to rank by)."""
        return [*self.retracted, *self._reqs]

    def by_cached_match(self, matcher: PrefixMatcher) -> list[tuple[Req, int]]:
        """Every waiting request with the length of its longest cached prefix (not yet capped by
        :attr:`Req.match_limit`): retracted ones first, then the rest by that length, longest first, ties in prompt
        order. In prompt order each walk of the tree resumes where its predecessor's passed through their common
        prefix (``_lcp``), so a window of prompts sharing a long prefix walks it once."""
        retracted = [(r, matcher.match_len(r.fill_ids(r.fill_len), 0)) for r in self.retracted]
        matches = [matcher.match_len(req.prompt_ids, self._lcp[i]) for i, req in enumerate(self._reqs)]
        ranked = sorted(range(len(self._reqs)), key=lambda i: -matches[i])
        return retracted + [(self._reqs[i], matches[i]) for i in ranked]
