"""Shared-prefix (cascade) attention: requests whose K/V start with the same slots read that prefix once.

With the prefix cache, the requests of a round often hold the same slots for a long prefix (an evaluation
task's few-shot examples, a system prompt). Attention splits exactly over a partition of the keys (Juravsky
et al. 2024, "Hydragen"; FlashInfer's cascade attention): for a query, with ``lse`` the log-sum-exp of its
scores over a part of the keys and ``o`` its softmax-weighted values over that part,
``o = o_1 · exp(lse_1 − lse) + o_2 · exp(lse_2 − lse)`` with ``lse = log(exp(lse_1) + exp(lse_2))``. So the
queries of all requests sharing a prefix (every position of those requests comes after it, so all of it is
visible) attend to it as one matrix product per KV head, run by oneDNN on the matrix unit where there is one,
instead of once per request; each request then attends to its own keys past the prefix (padded, masked, one
batched product) and the two parts are merged.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

# A prefix shorter than this is attended with the request's own keys: the merge would cost more than it saves.
MIN_SHARED_TOKENS = 64


@dataclass
class PrefixGroup:
    """Requests sharing the KV slots ``slots`` (int64 ``[P]``) of positions ``0..P - 1``; ``token_index``:
    int64 ``[m]``, the rows of q holding their new tokens."""

    slots: torch.Tensor
    token_index: torch.Tensor


@dataclass
class SharedPrefixPlan:
    """A round's shared prefixes and, for the requests in them, their own keys past the prefix.

    Attributes:
        grouped: the batch rows (requests) whose attention this plan computes; the backend skips them.
        groups: one per shared prefix.
        token_index: int64 ``[n, q_len]``, each grouped request's query rows in q (padding repeats the last).
        valid: bool ``[n, q_len]``, False on padding.
        kv_indices: int64 ``[n, L]``, each request's slots past its prefix, padded with slot 0.
        mask: bool ``[n, q_len, L]``, key in the request and not after the query.
    """

    grouped: set[int]
    groups: list[PrefixGroup]
    token_index: torch.Tensor
    valid: torch.Tensor
    kv_indices: torch.Tensor
    mask: torch.Tensor


def plan_shared_prefixes(
    req_to_token: torch.Tensor, req_pool_indices: list[int], seq_lens: list[int], q_lens: list[int]
) -> SharedPrefixPlan | None:
    """Find the requests of a round that share at least ``MIN_SHARED_TOKENS`` leading slots with another.

    Requests share a slot only through the prefix cache or an ``n > 1`` fork, which share whole prefixes, so
    requests holding the same slot at a position hold the same slots before it. Rows are grouped by their slot at
    ``MIN_SHARED_TOKENS - 1``; a group's prefix is as long as all its rows agree, within what each row's
    queries all see (``seq_len - q_len``); rows of a group that agree further (hold the same slot where the
    group's prefix ends) split off into deeper groups, so each request reads its longest shared prefix.

    Args:
        req_to_token: the request rows' slots (CPU); the others: per request of the round, in order.

    Returns:
        ``None`` when no two requests share enough.
    """
    visible = [s - q for s, q in zip(seq_lens, q_lens)]
    candidates = [i for i, v in enumerate(visible) if v >= MIN_SHARED_TOKENS]
    if len(candidates) < 2:
        return None
    width = max(seq_lens[i] for i in candidates)
    table = req_to_token[torch.tensor([req_pool_indices[i] for i in candidates]), :width]
    row_of = {i: k for k, i in enumerate(candidates)}
    found: list[tuple[list[int], int]] = []
    stack = _split(candidates, MIN_SHARED_TOKENS - 1, table, row_of, visible)
    while stack:
        rows, start = stack.pop()
        sub = table[[row_of[i] for i in rows], start : min(visible[i] for i in rows)]
        prefix = start + int((sub == sub[:1]).all(0).long().cumprod(0).sum())
        deeper = _split(rows, prefix, table, row_of, visible)
        stack.extend(deeper)
        taken = {i for group, _ in deeper for i in group}
        rest = [i for i in rows if i not in taken]
        if len(rest) >= 2:
            found.append((rest, prefix))
    if not found:
        return None
    return _plan(found, table, row_of, seq_lens, q_lens)


def _split(
    rows: list[int], at: int, table: torch.Tensor, row_of: dict[int, int], visible: list[int]
) -> list[tuple[list[int], int]]:
    """The groups of at least two of ``rows`` that hold the same slot at position ``at`` (so share positions
    ``0..at``), each with that shared length."""
    by_slot: defaultdict[int, list[int]] = defaultdict(list)
    for i in rows:
        if visible[i] > at:
            by_slot[int(table[row_of[i], at])].append(i)
    return [(group, at + 1) for group in by_slot.values() if len(group) >= 2]


def _plan(
    found: list[tuple[list[int], int]],
    table: torch.Tensor,
    row_of: dict[int, int],
    seq_lens: list[int],
    q_lens: list[int],
) -> SharedPrefixPlan:
    q_starts = [0]
    for q in q_lens[:-1]:
        q_starts.append(q_starts[-1] + q)
    groups = []
    rows: list[int] = []
    prefixes: list[int] = []
    for members, prefix in found:
        token_index = torch.cat([torch.arange(q_starts[i], q_starts[i] + q_lens[i]) for i in members])
        groups.append(PrefixGroup(table[row_of[members[0]], :prefix].clone(), token_index))
        rows.extend(members)
        prefixes.extend([prefix] * len(members))
    start = torch.tensor(prefixes)
    seq = torch.tensor([seq_lens[i] for i in rows])
    q_len = torch.tensor([q_lens[i] for i in rows])
    slot = torch.arange(int(q_len.max()))
    valid = slot[None, :] < q_len[:, None]
    token_index = torch.tensor([q_starts[i] for i in rows])[:, None] + torch.minimum(slot[None, :], q_len[:, None] - 1)
    key_pos = start[:, None] + torch.arange(int((seq - start).max()))[None, :]
    in_seq = key_pos < seq[:, None]
    own = table[[row_of[i] for i in rows]]
    kv_indices = own.gather(1, key_pos.clamp(max=own.shape[1] - 1)).masked_fill(~in_seq, 0)
    q_pos = (seq - q_len)[:, None] + slot[None, :]
    mask = in_seq[:, None, :] & (key_pos[:, None, :] <= q_pos[:, :, None])
    return SharedPrefixPlan(set(rows), groups, token_index, valid, kv_indices, mask)


def attend_shared_prefixes(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, plan: SharedPrefixPlan, out: torch.Tensor
) -> None:
    """Write the attention of the plan's requests' queries into ``out``.

    Args:
        q: ``[T, num_heads, head_dim]`` the round's queries; out: the same shape, written at the plan's rows.
        k_buffer, v_buffer: one layer's ``[num_kv_heads, slots, head_dim]`` pool.
    """
    num_kv_heads, _, head_dim = k_buffer.shape
    group = q.shape[1] // num_kv_heads
    scale = head_dim**-0.5
    n, q_len = plan.token_index.shape
    flat = plan.kv_indices.flatten()
    k = k_buffer.index_select(1, flat).view(num_kv_heads, n, -1, head_dim)
    v = v_buffer.index_select(1, flat).view(num_kv_heads, n, -1, head_dim)
    # [n, q_len, Hkv, G, D] → [Hkv, n, q_len * G, D]: a request's queries and grouped heads share its keys.
    queries = q[plan.token_index.flatten()].view(n, q_len, num_kv_heads, group, head_dim)
    qh = queries.permute(2, 0, 1, 3, 4).reshape(num_kv_heads, n, q_len * group, head_dim)
    scores = torch.matmul(qh * scale, k.transpose(-1, -2)).float()
    mask = plan.mask[:, :, None, :].expand(n, q_len, group, -1).reshape(n, q_len * group, -1)
    own_out, own_lse = _softmax_values(scores.masked_fill_(~mask, float("-inf")), v)
    # Back to token-major: [Hkv, n, q_len, G, ·] → [n * q_len, H, ·].
    own_out = own_out.view(num_kv_heads, n, q_len, group, head_dim).permute(1, 2, 0, 3, 4)
    own_out = own_out.reshape(n * q_len, num_kv_heads * group, head_dim)
    own_lse = own_lse.view(num_kv_heads, n, q_len, group).permute(1, 2, 0, 3).reshape(n * q_len, -1)
    keep = plan.valid.flatten()
    own_out, own_lse = own_out[keep], own_lse[keep]
    rows = plan.token_index.flatten()[keep]
    # The same query rows, grouped by prefix, in the plan's request order.
    offset = 0
    for prefix in plan.groups:
        m = prefix.token_index.numel()
        pre_out, pre_lse = _prefix_attention(q[prefix.token_index] * scale, k_buffer, v_buffer, prefix.slots)
        lse = torch.logaddexp(pre_lse, own_lse[offset : offset + m])
        merged = pre_out * torch.exp(pre_lse - lse)[..., None]
        merged += own_out[offset : offset + m] * torch.exp(own_lse[offset : offset + m] - lse)[..., None]
        out[rows[offset : offset + m]] = merged.to(out.dtype)
        offset += m


def _prefix_attention(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled queries ``[m, H, D]`` against the keys of ``slots``, all visible: float32 ``[m, H, D]`` values and
    ``[m, H]`` log-sum-exp."""
    num_kv_heads, _, head_dim = k_buffer.shape
    m, num_heads, _ = q.shape
    group = num_heads // num_kv_heads
    k = k_buffer.index_select(1, slots)  # [Hkv, P, D]
    v = v_buffer.index_select(1, slots)
    qh = q.view(m, num_kv_heads, group, head_dim).transpose(0, 1).reshape(num_kv_heads, m * group, head_dim)
    values, lse = _softmax_values(torch.matmul(qh, k.transpose(-1, -2)).float(), v)
    values = values.view(num_kv_heads, m, group, head_dim).transpose(0, 1).reshape(m, num_heads, head_dim)
    return values, lse.view(num_kv_heads, m, group).transpose(0, 1).reshape(m, num_heads)


def _softmax_values(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(scores) @ v`` in float32 and the scores' log-sum-exp (over the last axis; ``scores`` float32, is
    overwritten). As SDPA does, the probabilities are rounded to ``v``'s dtype before weighting it."""
    top = scores.amax(-1, keepdim=True)
    probs = scores.sub_(top).exp_()
    total = probs.sum(-1, keepdim=True)
    values = torch.matmul(probs.to(v.dtype), v).float() / total
    return values, (top + total.log()).squeeze(-1)
