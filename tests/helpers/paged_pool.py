"""A one-layer paged KV pool with scattered slots and NaN everywhere a kernel must not read, and a float64
attention reference: shared by the attention-kernel tests (Triton, C++); and the C++ kernel called over such a
pool's sequences."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import torch

from batchgen.kernels.cpu import BrgemmRows


class PagedPool:
    """One layer of a paged pool holding random K/V for sequences of the given lengths.

    Each sequence's slots are a random, unordered draw from the pool; slots no sequence owns, and the
    ``req_to_token`` entries past each sequence's end, point at NaN, so any stray read shows in the output.
    Row 0 and slot 0 are the pool's dummies (slot 0 zero, as in ``TokenToKVPool``). ``k``, ``v``:
    ``[num_kv_heads, num_slots + 1, head_dim]``; ``slots[i]``: sequence i's slots in position order.
    """

    def __init__(
        self,
        seq_lens: list[int],
        dtype: torch.dtype,
        num_kv_heads: int,
        head_dim: int,
        gen: torch.Generator,
        num_slots: int,
        context: int,
    ) -> None:
        shape = (num_kv_heads, num_slots + 1, head_dim)
        self.k = torch.full(shape, float("nan"), dtype=dtype)
        self.v = torch.full(shape, float("nan"), dtype=dtype)
        self.k[:, 0] = 0
        self.v[:, 0] = 0
        rows = len(seq_lens) + 3
        self.req_to_token = torch.randint(1, num_slots + 1, (rows, context), generator=gen)
        self.req_pool_indices = torch.randperm(rows - 1, generator=gen)[: len(seq_lens)] + 1
        free = torch.randperm(num_slots, generator=gen) + 1
        owned = torch.zeros(num_slots + 1, dtype=torch.bool)
        self.slots: list[torch.Tensor] = []
        for row, n in zip(self.req_pool_indices.tolist(), seq_lens):
            slots, free = free[:n], free[n:]
            self.req_to_token[row, :n] = slots
            owned[slots] = True
            self.k[:, slots] = torch.randn(num_kv_heads, n, head_dim, generator=gen).to(dtype)
            self.v[:, slots] = torch.randn(num_kv_heads, n, head_dim, generator=gen).to(dtype)
            self.slots.append(slots)
        unowned = (~owned).nonzero().flatten()
        unowned = unowned[unowned > 0]
        for row, n in zip(self.req_pool_indices.tolist(), seq_lens):
            self.req_to_token[row, n:] = unowned[torch.randint(len(unowned), (context - n,), generator=gen)]

    def to(self, device: torch.device) -> PagedPool:
        """This pool with its tensors (not ``slots``, which index the CPU copies a reference reads) on ``device``."""
        moved = copy.copy(self)
        moved.k, moved.v = self.k.to(device), self.v.to(device)
        moved.req_to_token, moved.req_pool_indices = self.req_to_token.to(device), self.req_pool_indices.to(device)
        return moved


def decode_batch(pool: PagedPool, rows: list[int], seq_lens: list[int]) -> Any:
    """The parts of a DECODE ForwardBatch an attention backend reads, for the pool's sequences ``rows`` (indices)
    at lengths ``seq_lens``, on the pool's device; ``max_seq_len`` is poisoned (a graph-safe backend must not read
    it)."""
    from batchgen.loop.forward_mode import ForwardMode

    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        batch_size=len(rows),
        req_pool_indices=pool.req_pool_indices[rows],
        seq_lens=torch.tensor(seq_lens, device=pool.k.device),
        max_seq_len=None,
        extend_seq_lens_cpu=None,
        extend_prefix_lens_cpu=None,
        req_to_token_pool=SimpleNamespace(req_to_token=pool.req_to_token),
        token_to_kv_pool=SimpleNamespace(k_buffer=pool.k[None], v_buffer=pool.v[None]),
    )


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int) -> torch.Tensor:
    """float64 causal attention of ``q`` ``[n, H, D]`` (positions ``first_pos..``) over ``k``, ``v``
    ``[Hkv, S, D]`` (GQA: query head h uses KV head ``h // (H / Hkv)``), scale ``D ** -0.5``."""
    n, num_heads, head_dim = q.shape
    group = num_heads // k.shape[0]
    k = k.double().repeat_interleave(group, 0)
    v = v.double().repeat_interleave(group, 0)
    scores = torch.einsum("nhd,hsd->hns", q.double(), k) * head_dim**-0.5
    visible = torch.arange(k.shape[1])[None, :] <= torch.arange(first_pos, first_pos + n)[:, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hns,hsd->nhd", probs, v)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| over one request's rows: outputs are averages of unit-scale values."""
    return float((out.double() - ref).abs().max() / ref.abs().max())


def index(values: list[int]) -> torch.Tensor:
    """int64 1-D tensor of ``values``."""
    return torch.tensor(values, dtype=torch.int64)


def pool_reference(q: torch.Tensor, pool: PagedPool, i: int, first_pos: int) -> torch.Tensor:
    """The float64 reference for new tokens ``q`` of the pool's sequence ``i``, the first at ``first_pos``."""
    return reference_attention(q, pool.k[:, pool.slots[i]], pool.v[:, pool.slots[i]], first_pos)


def kernel_attention(
    pool: PagedPool,
    q: torch.Tensor,
    rows: list[int],
    seq_lens: list[int],
    q_lens: list[int],
    brgemm: BrgemmRows = BrgemmRows.NEVER,
) -> torch.Tensor:
    """batchgen's C++ kernel over ``rows`` (indices into the pool's sequences), their new tokens packed in order in
    q; the rows ``brgemm`` names through brgemm."""
    from batchgen.kernels.cpu import paged_attention

    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    return paged_attention(
        q,
        pool.k,
        pool.v,
        pool.req_to_token,
        pool.req_pool_indices[rows],
        index(seq_lens),
        index(starts),
        index(q_lens),
        q.shape[-1] ** -0.5,
        brgemm=brgemm,
    )


def share_prefix(pool: PagedPool, shares: dict[int, tuple[int, int]]) -> None:
    """Sequence ``row``'s first ``length`` slots become sequence ``source``'s (``shares[row] = (source, length)``),
    as the prefix cache hands them out; ``pool.slots`` follows, so the reference reads the same K/V."""
    for row, (source, length) in shares.items():
        slots = pool.slots[source][:length]
        pool.req_to_token[pool.req_pool_indices[row], :length] = slots
        pool.slots[row] = torch.cat([slots, pool.slots[row][length:]])


def skip_without_cpu_kernel() -> None:
    """Skip the test, saying why, where batchgen's C++ kernels cannot be built (no compiler or ninja)."""
    import pytest

    from batchgen.kernels.cpu import build_problem

    problem = build_problem()
    if problem is not None:
        pytest.skip(f"the C++ kernel cannot be built on this machine: {problem}")


def skip_without_brgemm(head_dim: int = 64) -> None:
    """Skip the test, saying why, where the kernel has no brgemm path for bfloat16 heads of ``head_dim``."""
    import pytest

    from batchgen.kernels.cpu import brgemm_attention_supported

    if not brgemm_attention_supported(torch.bfloat16, head_dim):
        pytest.skip("PyTorch's brgemm cannot run bfloat16 here (it needs AVX512-BF16 or AMX): no brgemm path")
