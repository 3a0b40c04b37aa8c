"""``RadixCache``: the K/V of token prefixes already computed, for every later request that starts with them.

SGLang's RadixAttention (Zheng et al. 2024, "SGLang: Efficient Execution of Structured Language Model Programs",
section 3) at page size 1: a radix tree whose edges are runs of token ids and whose nodes hold the KV slots of
their run, so the path from the root to a node spells a token prefix and lists the slots of its K/V. A node holds
one reference on each of its slots (:class:`~batchgen.loop.kv_pool.KVSlotAllocator` counts them), as a request row
does on the slots it reads; a slot is free only when neither holds it.

``lock_ref`` counts the requests that read a node's path: a locked node is never evicted. Every slot that a
request holds *and* the tree holds lies on a path that request locks (``KVCache`` keeps this), so evicting an
unlocked node frees its slots at once, and ``evictable_size`` is exactly what eviction can give back. Eviction takes
unlocked leaves, least recently matched or inserted first.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from batchgen.loop.kv_pool import KVSlotAllocator


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share.

    Bisects on slice equality, which runs in C: ``O(len)`` element compares and ``O(log len)`` Python steps,
    where a token-by-token loop would take ``O(len)`` Python steps.
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low] and a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid
    return low


@dataclass(eq=False)
class TreeNode:
    """One edge of the tree and the node it leads to.

    Attributes:
        key: the token ids of the edge (non-empty except at the root).
        value: int64 ``[len(key)]`` on the CPU, the KV slot of each of those tokens.
        parent: ``None`` at the root.
        children: by the first token of their edge.
        lock_ref: requests reading a path through this node.
        last_access: a tick of the tree's clock: when a match or an insert last passed here.
    """

    key: list[int]
    value: torch.Tensor
    parent: TreeNode | None
    children: dict[int, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0


class RadixCache:
    """The tree of cached prefixes over one KV pool (see the module docstring).

    Args:
        allocator: the pool's slot allocator; the tree takes a reference on the slots it inserts and drops them
            when it evicts.
    """

    def __init__(self, allocator: KVSlotAllocator) -> None:
        self.allocator = allocator
        self.root = TreeNode([], torch.empty(0, dtype=torch.int64), None, lock_ref=1)
        self.evictable_size = 0  # tokens in unlocked nodes
        self.total_size = 0  # tokens in all nodes
        self._clock = itertools.count(1)

    def match_prefix(self, tokens: Sequence[int]) -> tuple[torch.Tensor, TreeNode]:
        """The slots of the longest cached prefix of ``tokens`` and the node whose path is exactly that prefix
        (an edge the match ends inside is split there). Marks the path as just used.

        Returns:
            int64 ``[m]`` slots on the CPU (``m`` the match length) and the node (the root when ``m == 0``).
        """
        node, values = self._descend(tokens)
        return (torch.cat(values) if values else self.root.value), node

    def insert(self, tokens: Sequence[int], slots: torch.Tensor) -> tuple[TreeNode, torch.Tensor]:
        """Cache ``tokens`` whose K/V are in ``slots`` (int64 ``[len(tokens)]``): the tokens past the longest
        cached prefix become a new leaf holding their slots (one more reference each); the cached part keeps the
        tree's own slots.

        Returns:
            The node whose path is exactly ``tokens``, and the tree's slots for ``tokens`` (int64 on the CPU), which
            differ from ``slots`` where another request had computed the same tokens first.
        """
        node, values = self._descend(tokens)
        matched = sum(len(v) for v in values)
        if matched < len(tokens):
            leaf = TreeNode(
                list(tokens[matched:]), slots.to("cpu")[matched:].clone(), node, last_access=node.last_access
            )
            self.allocator.share(leaf.value)
            node.children[leaf.key[0]] = leaf
            self.evictable_size += len(leaf.key)
            self.total_size += len(leaf.key)
            node = leaf
            values.append(leaf.value)
        return node, (torch.cat(values) if values else self.root.value)

    def lock(self, node: TreeNode) -> None:
        """One more request reads the path to ``node``: none of it is evicted until :meth:`unlock`."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one :meth:`lock` of ``node``."""
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free the slots of unlocked leaves, least recently used first, until ``num_tokens`` are freed or nothing
        unlocked is left; return how many were freed."""
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            self.allocator.free(leaf.value)
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            self.evictable_size -= len(leaf.key)
            self.total_size -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    def _descend(self, tokens: Sequence[int]) -> tuple[TreeNode, list[torch.Tensor]]:
        """Walk down the longest cached prefix of ``tokens``, splitting the edge it ends inside and marking the
        path as just used: the node whose path is exactly that prefix, and the slots of each edge on the way."""
        node, matched = self.root, 0
        values: list[torch.Tensor] = []
        node.last_access = tick = next(self._clock)
        while matched < len(tokens) and (child := node.children.get(tokens[matched])) is not None:
            n = common_prefix_len(child.key, tokens[matched : matched + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            values.append(child.value)
            matched += n
            node = child
        return node, values

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child``'s edge after ``n`` tokens (0 < n < len(key)); return the new node of the first part.
        It is on every path ``child`` was on, so it takes ``child``'s lock count."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        head = TreeNode(child.key[:n], child.value[:n], parent, lock_ref=child.lock_ref, last_access=child.last_access)
        head.children[child.key[n]] = child
        parent.children[head.key[0]] = head
        child.key, child.value, child.parent = child.key[n:], child.value[n:], head
        return head

    def _nodes(self) -> list[TreeNode]:
        """Every node but the root."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


class PrefixMatcher:
    """Match lengths of many sequences against ``tree`` (changing nothing), each walk resuming where the previous
    sequence's walk passed through the part the two share: over prompts in sorted order that share a long prefix,
    only their differing tails are walked."""

    def __init__(self, tree: RadixCache) -> None:
        self.tree = tree
        self._path: list[tuple[int, TreeNode]] = [(0, tree.root)]  # (depth, node) the last walk passed wholly

    def match_len(self, tokens: Sequence[int], shared: int) -> int:
        """Length of the longest cached prefix of ``tokens``, which share their first ``shared`` tokens with the
        sequence of the previous call (0 for none)."""
        while self._path[-1][0] > shared:
            self._path.pop()
        matched, node = self._path[-1]
        while matched < len(tokens) and (child := node.children.get(tokens[matched])) is not None:
            n = common_prefix_len(child.key, tokens[matched : matched + len(child.key)])
            matched += n
            if n < len(child.key):
                break
            node = child
            self._path.append((matched, node))
        return matched
