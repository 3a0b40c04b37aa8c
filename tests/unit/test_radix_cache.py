"""The radix prefix cache, its KV accounting and the waiting queue's order, against hand-computed values and
brute-force references (the longest common prefix with any cached sequence)."""

from __future__ import annotations

import random

import torch

from batchgen.loop.kv_cache import KVCache
from batchgen.loop.kv_pool import KVSlotAllocator, ReqToTokenPool
from batchgen.loop.radix_cache import PrefixMatcher, RadixCache, common_prefix_len
from batchgen.loop.req import Req
from batchgen.loop.waiting_queue import WaitingQueue
from batchgen.sampling.sampling_params import SamplingParams


def _match_len(tree: RadixCache, tokens: list[int]) -> int:
    return PrefixMatcher(tree).match_len(tokens, 0)


def _brute_lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_common_prefix_len_equals_a_token_loop() -> None:
    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(40))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(40))]
        assert common_prefix_len(a, b) == _brute_lcp(a, b)


def test_match_insert_split_and_shared_slots() -> None:
    allocator = KVSlotAllocator(16)
    slots = allocator.alloc(8)  # 1..8, one reference each (a request's)
    tree = RadixCache(allocator)
    tree.insert([1, 2, 3, 4], slots[:4])
    assert _match_len(tree, [1, 2, 3, 9]) == 3 and _match_len(tree, [5]) == 0 and _match_len(tree, [1, 2, 3, 4, 5]) == 4
    # [1, 2] is cached with slots 1, 2: a second insert keeps those and adds only its own tail [5, 6].
    tree.insert([1, 2, 5, 6], slots[4:])
    assert tree.total_size == 6 and tree.evictable_size == 6
    matched, node = tree.match_prefix([1, 2, 5, 6, 7])
    assert matched.tolist() == [1, 2, 7, 8]
    matched, node = tree.match_prefix([1, 2, 3, 7])  # ends inside the edge [3, 4]: split after 3
    assert matched.tolist() == [1, 2, 3] and node.key == [3]
    # The tree holds one reference on slots 1-4, 7, 8; slots 5, 6 only the request does.
    assert torch.equal(allocator._refs[1:9], torch.tensor([2, 2, 2, 2, 1, 1, 2, 2], dtype=torch.int32))


def test_lock_and_lru_eviction() -> None:
    allocator = KVSlotAllocator(16)
    tree = RadixCache(allocator)
    a = allocator.alloc(3)
    b = allocator.alloc(3)
    c = allocator.alloc(2)
    tree.insert([1, 2, 3], a)
    tree.insert([1, 2, 7], torch.cat([a[:2], b[2:]]))
    tree.insert([9, 9], c)
    for held in (a, b, c):
        allocator.free(held)  # the requests finished: the tree alone holds its slots
    assert allocator.available() == 16 - 6 and tree.evictable_size == 6
    _, node = tree.match_prefix([1, 2, 3])  # [1, 2, 3] used last; [1, 2, 7] least recently
    tree.lock(node)
    assert tree.evictable_size == 3  # [1, 2] and [3] locked
    assert tree.evict(1) == 1  # the LRU unlocked leaf: [7]
    assert _match_len(tree, [1, 2, 7]) == 2 and allocator.available() == 11
    assert tree.evict(100) == 2  # [9, 9]; the locked path stays
    assert _match_len(tree, [1, 2, 3]) == 3 and _match_len(tree, [9, 9]) == 0
    tree.unlock(node)
    assert tree.evict(100) == 3 and tree.total_size == 0 and allocator.available() == 16


def test_kv_cache_accounting_survives_random_requests() -> None:
    """Requests matching, computing, caching, forking and releasing at random: ``available()`` is always what
    ``allocate`` can deliver (it never raises), and once all are released every slot is free or evictable."""
    rng = random.Random(1)
    size = 64
    cache = KVCache(ReqToTokenPool(8, 32, torch.device("cpu")), KVSlotAllocator(size), None)
    cache.radix_cache = RadixCache(cache.allocator)
    prefixes = [[rng.randrange(4) for _ in range(12)] for _ in range(3)]
    live: list[tuple[int, list[int], int]] = []  # (row, tokens, kv_len)
    for _ in range(400):
        if live and (rng.random() < 0.4 or not cache.available_rows()):
            row, tokens, kv_len = live.pop(rng.randrange(len(live)))
            cache.cache(row, tokens[:kv_len])
            cache.release(row, kv_len)
            continue
        tokens = rng.choice(prefixes)[: rng.randrange(1, 13)] + [rng.randrange(4) for _ in range(rng.randrange(10))]
        row = cache.allocate_rows(1)[0]
        kv_len = cache.match(row, tokens[:-1])
        assert kv_len == _brute_best(tokens[:-1], cache)
        need = len(tokens) - kv_len
        if need > cache.available():
            cache.release(row, kv_len)
            continue
        cache.allocate([row] * need, torch.arange(kv_len, len(tokens)))
        cache.cache(row, tokens)
        if live and rng.random() < 0.3 and cache.available_rows():
            child = cache.allocate_rows(1)[0]
            cache.fork(row, len(tokens), child)
            live.append((child, tokens, len(tokens)))
        live.append((row, tokens, len(tokens)))
    for row, _, kv_len in live:
        cache.release(row, kv_len)
    assert cache.available() == size
    cached = cache.radix_cache.total_size
    assert cache.radix_cache.evict(size) == cached
    assert cache.allocator.available() == size


def _brute_best(tokens: list[int], cache: KVCache) -> int:
    """Brute force: the longest prefix of ``tokens`` spelled by a root-to-node path of the tree."""
    assert cache.radix_cache is not None
    best, stack = 0, [(cache.radix_cache.root, [])]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            spelled = path + child.key
            best = max(best, _brute_lcp(tokens, spelled))
            stack.append((child, spelled))
    return best


def _req(rid: str, prompt: list[int]) -> Req:
    return Req(rid, prompt, SamplingParams(max_new_tokens=4), seed=0, stop_token_ids=frozenset(), max_total_len=64)


def test_waiting_queue_ranks_by_cached_match_like_brute_force() -> None:
    rng = random.Random(2)
    allocator = KVSlotAllocator(4096)
    tree = RadixCache(allocator)
    cached = [[rng.randrange(3) for _ in range(rng.randrange(1, 12))] for _ in range(20)]
    for seq in cached:
        tree.insert(seq, allocator.alloc(len(seq)))
    queue = WaitingQueue(by_prefix=True)
    reqs = [_req(str(i), [rng.randrange(3) for _ in range(rng.randrange(1, 14))]) for i in range(300)]
    for req in reqs:
        queue.append(req)
    for req in rng.sample(reqs, 100):
        queue.remove(req)
    retracted = _req("back", [2, 2, 2])
    queue.appendleft(retracted)
    ranked = queue.by_cached_match(PrefixMatcher(tree))
    assert ranked[0] == (retracted, max(_brute_lcp([2, 2, 2], s) for s in cached))
    rest = ranked[1:]
    assert len(rest) == 200 == len(queue) - 1
    for req, match in rest:
        assert match == max(_brute_lcp(req.prompt_ids, s) for s in cached), req.prompt_ids
    matches = [m for _, m in rest]
    assert matches == sorted(matches, reverse=True)
    # Ties keep prompt order: prompts sharing a prefix stay side by side.
    for (a, ma), (b, mb) in zip(rest, rest[1:]):
        if ma == mb:
            assert a.prompt_ids <= b.prompt_ids


def test_waiting_queue_without_cache_is_first_come_first_served() -> None:
    queue = WaitingQueue(by_prefix=False)
    reqs = [_req(str(i), [5 - i]) for i in range(5)]
    for req in reqs:
        queue.append(req)
    queue.remove(reqs[2])
    queue.appendleft(reqs[2])
    assert [r.rid for r in queue.in_order()] == ["2", "0", "1", "3", "4"]


def test_drop_cached_frees_what_no_request_reads() -> None:
    cache = KVCache(ReqToTokenPool(4, 16, torch.device("cpu")), KVSlotAllocator(32), None)
    cache.radix_cache = RadixCache(cache.allocator)
    reader, done = cache.allocate_rows(2)
    for row in (reader, done):
        cache.allocate([row] * 6, torch.arange(6))
    cache.cache(reader, [1, 2, 3, 4, 5, 6])
    cache.cache(done, [1, 2, 3, 7, 8, 9])
    cache.release(done, 6)  # [7, 8, 9] is now held by the tree alone; [1, 2, 3] and [4, 5, 6] are read
    assert cache.drop_cached() == 3
    assert cache.allocator.available() == 32 - 6 and cache.available() == 32 - 6
