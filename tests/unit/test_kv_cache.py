"""The KV-cache home: request rows, slots written to req_to_token, forks sharing slots, truncation and release.

Expected values are worked out by hand from the pools' documented order: request rows are handed out 1, 2, 3, …
and slots lowest first, those freed since the last allocation before the rest, in the order they were freed.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.loop.kv_cache import KVCache
from batchgen.loop.kv_pool import KVSlotAllocator, ReqToTokenPool


def _cache(rows: int = 4, context: int = 8, slots: int = 10) -> KVCache:
    return KVCache(ReqToTokenPool(rows, context, torch.device("cpu")), KVSlotAllocator(slots))


def _table(cache: KVCache, row: int, length: int) -> list[int]:
    return cache.req_to_token_pool.req_to_token[row, :length].tolist()


def test_allocate_writes_each_tokens_slot_at_its_row_and_position() -> None:
    cache = _cache()
    assert cache.allocate_rows(2) == [1, 2] and cache.available_rows() == 2
    # Three tokens of row 1 at positions 0..2 and two of row 2 at positions 0..1: slots 1..5 in token order.
    loc = cache.allocate([1, 1, 1, 2, 2], torch.tensor([0, 1, 2, 0, 1]))
    assert loc.tolist() == [1, 2, 3, 4, 5]
    assert _table(cache, 1, 3) == [1, 2, 3] and _table(cache, 2, 2) == [4, 5]
    assert cache.available() == 5 and cache.size == 10
    # A later round appends at the next position: row 2's third token gets slot 6.
    assert cache.allocate([2], torch.tensor([2])).tolist() == [6]
    assert _table(cache, 2, 3) == [4, 5, 6] and cache.available() == 4


def test_fork_shares_the_prompts_slots_until_every_holder_releases_them() -> None:
    cache = _cache()
    parent, child_a, child_b = cache.allocate_rows(3)
    cache.allocate([parent] * 4, torch.arange(4))  # a 4-token prompt in slots 1..4
    cache.fork(parent, 4, child_a)
    cache.fork(parent, 4, child_b)
    assert _table(cache, child_a, 4) == _table(cache, child_b, 4) == [1, 2, 3, 4]
    assert cache.available() == 6  # shared, not copied: each of slots 1..4 has 3 holders
    cache.allocate([child_a, child_b], torch.tensor([4, 4]))  # each sample's first own token: slots 5 and 6
    assert cache.available() == 4
    cache.release(parent, 4)  # slots 1..4 keep 2 holders
    assert cache.available() == 4 and cache.available_rows() == 2
    cache.release(child_a, 5)  # slots 1..4 keep 1 holder; slot 5 is free
    assert cache.available() == 5
    cache.release(child_b, 5)
    assert cache.available() == 10 and cache.available_rows() == 4


def test_truncate_frees_rejected_positions_and_keeps_shared_ones_held() -> None:
    cache = _cache()
    parent, child = cache.allocate_rows(2)
    cache.allocate([parent] * 3, torch.arange(3))  # slots 1..3
    cache.fork(parent, 3, child)
    cache.allocate([child] * 4, torch.arange(3, 7))  # pending token and 3 drafts: slots 4..7
    assert cache.available() == 3
    cache.truncate(child, 5, 7)  # two drafts rejected: slots 6 and 7 go back
    assert cache.available() == 5
    cache.truncate(child, 0, 5)  # the child lets go of everything: its own slots 4, 5 free, the prompt's not
    assert cache.available() == 7
    assert _table(cache, parent, 3) == [1, 2, 3]
    # Freed slots are handed out again first, in the order they were freed (6, 7, then 4, 5), before 8..10.
    assert cache.allocate([child] * 4, torch.arange(4)).tolist() == [6, 7, 4, 5]


def test_release_of_a_reserved_row_frees_the_row_only() -> None:
    cache = _cache()
    (row,) = cache.allocate_rows(1)
    cache.release(row, 0)
    assert cache.available_rows() == 4 and cache.available() == 10


def test_running_out_of_rows_or_slots_raises() -> None:
    cache = _cache(rows=1, slots=2)
    cache.allocate_rows(1)
    with pytest.raises(RuntimeError, match="no free request row"):
        cache.allocate_rows(1)
    with pytest.raises(RuntimeError, match="KV pool exhausted"):
        cache.allocate([1, 1, 1], torch.arange(3))
