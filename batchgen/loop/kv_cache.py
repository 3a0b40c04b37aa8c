"""``KVCache``: where each request's tokens live, its request row of ``req_to_token`` and the KV slots behind it.

Every write to ``req_to_token`` and every free of a request row or a KV slot goes through this class: the
scheduler and ``ScheduleBatch.prepare`` ask it for rows and slots and never index the table themselves (as
SGLang's and mini-sglang's schedulers ask their cache). Page size is 1 token.

A slot is reference counted (:class:`KVSlotAllocator`): it holds K/V while any request row, or the prefix cache
(:class:`RadixCache`), holds it. The ``n`` samples of one prompt share the prompt's slots (:meth:`KVCache.fork`);
a request admitted with a cached prefix reads the tree's slots for it (:meth:`KVCache.match`), and what it
computes joins the tree (:meth:`KVCache.cache`). Each request row locks the tree path it reads or added, so
that every slot it shares with the tree lies on a locked path: unlocked tree slots are held by the tree alone,
and :meth:`available` can count them as free (they are evicted when :meth:`allocate` needs them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchgen.loop.kv_pool import KVSlotAllocator, ReqToTokenPool
from batchgen.loop.radix_cache import RadixCache, TreeNode


class KVCache:
    """Request rows (``req_to_token_pool``) and KV slots (``allocator``) of one model's pools, and its prefix
    cache (``radix_cache``; ``None`` when off).

    Position ``p`` of request row ``r`` is ``req_to_token[r, p]``; a request of ``length`` tokens with K/V holds
    positions ``0..length - 1`` of its row (callers keep ``length``: ``Req.kv_len`` for the target model).

    Raises:
        RuntimeError: from :meth:`allocate_rows` and :meth:`allocate` when the pool is short (callers check
            :meth:`available_rows` and :meth:`available` first).
    """

    def __init__(
        self, req_to_token_pool: ReqToTokenPool, allocator: KVSlotAllocator, radix_cache: RadixCache | None = None
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.radix_cache = radix_cache
        self._locks: dict[int, TreeNode] = {}  # request row → the tree node whose path it has locked

    @property
    def size(self) -> int:
        """KV slots in all (tokens)."""
        return self.allocator.size

    def available(self) -> int:
        """KV slots that no request holds: free ones, and those only the prefix cache holds (evictable)."""
        evictable = self.radix_cache.evictable_size if self.radix_cache is not None else 0
        return self.allocator.available() + evictable

    def available_rows(self) -> int:
        """Request rows that no request holds."""
        return self.req_to_token_pool.available()

    def allocate_rows(self, count: int) -> list[int]:
        """``count`` request rows, each holding no slots yet."""
        return [self.req_to_token_pool.alloc() for _ in range(count)]

    def allocate(self, rows: Sequence[int], positions: torch.Tensor) -> torch.Tensor:
        """A fresh slot for each of a round's tokens, recorded at ``req_to_token[rows[i], positions[i]]``.

        Args:
            rows: each token's request row; positions: int64 ``[T]`` on the CPU, each token's position.

        Returns:
            ``out_cache_loc``: int64 ``[T]`` on the CPU, the slots the forward writes the tokens' K/V to.
        """
        short = positions.numel() - self.allocator.available()
        if short > 0 and self.radix_cache is not None:
            self.radix_cache.evict(short)
        slots = self.allocator.alloc(positions.numel())
        table = self.req_to_token_pool.req_to_token
        table[torch.tensor(rows, device=table.device), positions.to(table.device)] = slots.to(table.device)
        return slots

    def drop_cached(self) -> int:
        """Evict every cached prefix that no request reads (a cold cache, e.g. before timing another system on
        the same prompts); return how many slots that freed."""
        return self.radix_cache.evict(self.radix_cache.evictable_size) if self.radix_cache is not None else 0

    def match(self, row: int, tokens: Sequence[int]) -> int:
        """Point the first positions of ``row`` (a fresh request row) at the cached K/V of the longest cached
        prefix of ``tokens``, hold those slots and lock their path; return the prefix's length (0 without a
        cache)."""
        if self.radix_cache is None:
            return 0
        slots, node = self.radix_cache.match_prefix(tokens)
        if slots.numel():
            table = self.req_to_token_pool.req_to_token
            table[row, : slots.numel()] = slots.to(table.device)
            self.allocator.share(slots)
        self._lock(row, node)
        return int(slots.numel())

    def cache(self, row: int, tokens: Sequence[int]) -> None:
        """Put ``tokens``, whose K/V are at the first ``len(tokens)`` positions of ``row``, into the prefix cache
        (no-op without one), and move the row's lock to their path: later requests starting with them hit.

        Where the tree already held some of them (another request computed them first, or a row asking for prompt
        logprobs took no match), the row switches to the tree's slots and lets go of its own copies, as SGLang's
        ``cache_unfinished_req`` does: the pool holds each cached token once, so a request that fits the pool
        alone still fits beside its cached prefix.
        """
        if self.radix_cache is None:
            return
        table = self.req_to_token_pool.req_to_token
        own = table[row, : len(tokens)].to("cpu", copy=True)
        node, cached = self.radix_cache.insert(tokens, own)
        differ = cached != own
        if bool(differ.any()):
            self.allocator.share(cached[differ])
            self.allocator.free(own[differ])
            table[row, : len(tokens)] = cached.to(table.device)
        self._lock(row, node)

    def fork(self, parent_row: int, length: int, child_row: int) -> None:
        """Give ``child_row`` the slots of the first ``length`` positions of ``parent_row`` (one more holder
        each) and the parent's lock: an ``n > 1`` sample reads its prompt's K/V without a copy. With a prefix
        cache the parent has cached its prompt first, so this is the sample's match of it in the tree."""
        table = self.req_to_token_pool.req_to_token
        slots = table[parent_row, :length]
        table[child_row, :length] = slots
        self.allocator.share(slots)
        if parent_row in self._locks:
            self._lock(child_row, self._locks[parent_row])

    def truncate(self, row: int, keep: int, length: int) -> None:
        """Let go of positions ``keep..length - 1`` of ``row`` (rejected drafts): their slots are free once no
        other row holds them."""
        self.allocator.free(self.req_to_token_pool.req_to_token[row, keep:length])

    def release(self, row: int, length: int) -> None:
        """Let go of the first ``length`` positions of ``row`` and of the row itself (a finished or retracted
        request; ``length`` 0 for a row reserved but never filled)."""
        self.truncate(row, 0, length)
        self._unlock(row)
        self.req_to_token_pool.free(row)

    def shared_len(self, row: int) -> int:
        """Tokens of the path ``row`` has locked in the prefix cache that another request locks too: on the row's
        release these stay held, while the rest of its positions become free or evictable (0 without a cache)."""
        node = self._locks.get(row)
        shared = 0
        while node is not None and node.parent is not None:
            if node.lock_ref > 1:
                shared += len(node.key)
            node = node.parent
        return shared

    def _lock(self, row: int, node: TreeNode) -> None:
        """Make ``node`` the one tree node ``row`` locks (lock first: the old path may share nodes with it)."""
        assert self.radix_cache is not None
        self.radix_cache.lock(node)
        self._unlock(row)
        self._locks[row] = node

    def _unlock(self, row: int) -> None:
        node = self._locks.pop(row, None)
        if node is not None and self.radix_cache is not None:
            self.radix_cache.unlock(node)
