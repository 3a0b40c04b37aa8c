"""``KVCache``: where each request's tokens live, its request row of ``req_to_token`` and the KV slots behind it.

Every write to ``req_to_token`` and every free of a request row or a KV slot goes through this class: the
scheduler and ``ScheduleBatch.prepare`` ask it for rows and slots and never index the table themselves (as
SGLang's and mini-sglang's schedulers ask their cache). Page size is 1 token.

A slot is reference counted (:class:`KVSlotAllocator`): it holds K/V while any request row holds it, so the
``n`` samples of one prompt share the prompt's slots (:meth:`KVCache.fork`). A cache of token prefixes (SGLang's
``RadixCache``: a tree whose nodes own slots and count the requests reading them) fits the same shape: it would
be one more holder of slots, matched against a prompt before :meth:`KVCache.allocate`, and unlocked, not freed,
by :meth:`KVCache.release`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchgen.loop.kv_pool import KVSlotAllocator, ReqToTokenPool


class KVCache:
    """Request rows (``req_to_token_pool``) and KV slots (``allocator``) of one model's pools.

    Position ``p`` of request row ``r`` is ``req_to_token[r, p]``; a request of ``length`` tokens with K/V holds
    positions ``0..length - 1`` of its row (callers keep ``length``: ``Req.kv_len`` for the target model).

    Raises:
        RuntimeError: from :meth:`allocate_rows` and :meth:`allocate` when the pool is short (callers check
            :meth:`available_rows` and :meth:`available` first).
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: KVSlotAllocator) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator

    @property
    def size(self) -> int:
        """KV slots in all (tokens)."""
        return self.allocator.size

    def available(self) -> int:
        """KV slots that no request holds."""
        return self.allocator.available()

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
        slots = self.allocator.alloc(positions.numel())
        table = self.req_to_token_pool.req_to_token
        table[torch.tensor(rows, device=table.device), positions.to(table.device)] = slots.to(table.device)
        return slots

    def fork(self, parent_row: int, length: int, child_row: int) -> None:
        """Give ``child_row`` the slots of the first ``length`` positions of ``parent_row`` (one more holder
        each): an ``n > 1`` sample reads its prompt's K/V without a copy."""
        table = self.req_to_token_pool.req_to_token
        slots = table[parent_row, :length]
        table[child_row, :length] = slots
        self.allocator.share(slots)

    def truncate(self, row: int, keep: int, length: int) -> None:
        """Let go of positions ``keep..length - 1`` of ``row`` (rejected drafts): their slots are free once no
        other row holds them."""
        self.allocator.free(self.req_to_token_pool.req_to_token[row, keep:length])

    def release(self, row: int, length: int) -> None:
        """Let go of the first ``length`` positions of ``row`` and of the row itself (a finished or retracted
        request; ``length`` 0 for a row reserved but never filled)."""
        self.truncate(row, 0, length)
        self.req_to_token_pool.free(row)
