"""The paged KV cache: request rows → KV slots, per-layer K/V buffers, and the free-slot allocator.

Page size is 1 token: a KV "slot" holds the key and value of one token in every layer. Slot 0 and request
row 0 are reserved dummies, so padded tokens can write somewhere harmless and padded rows read nothing real.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch

from batchgen.errors import BatchgenError

_T = TypeVar("_T")


def _allocate(make: Callable[[], _T], what: str) -> _T:
    """``make()``, its allocation failure turned into one line: "cannot allocate ``what``" (CPU allocators raise a
    plain RuntimeError, CUDA's torch.OutOfMemoryError, one of its subclasses)."""
    try:
        return make()
    except RuntimeError as e:
        if "alloc" not in str(e):
            raise
        raise BatchgenError(f"cannot allocate {what}") from None


class ReqToTokenPool:
    """Maps (request row, position) → KV slot.

    ``req_to_token``: int64 ``[max_reqs + 1, max_context_len]`` on ``device``; row 0 is the dummy row.

    Raises:
        BatchgenError: the device cannot allocate the table (naming its size).
        RuntimeError: from :meth:`alloc` when no row is free (the scheduler checks :meth:`available` first).
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device) -> None:
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        need = (max_reqs + 1) * max_context_len * 8
        self.req_to_token = _allocate(
            lambda: torch.zeros((max_reqs + 1, max_context_len), dtype=torch.int64, device=device),
            f"the table of {max_reqs} running requests of up to {max_context_len} tokens ({need / 2**30:.1f} GiB on "
            f"{device}); ask for fewer: a lower --max-running-requests (run, bench) or --context-length (run), or a "
            "smaller --batch-size (bench-one-batch)",
        )
        self._free_rows = list(range(max_reqs, 0, -1))

    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free request row")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        self._free_rows.append(row)


class TokenToKVPool:
    """Per-layer K and V buffers, each ``[num_layers, num_kv_heads, size + 1, head_dim]`` in ``dtype``.

    Head-major: gathering a batch's slots gives ``[num_kv_heads, tokens, head_dim]``, the layout attention
    multiplies with directly (a (head, request) pair's keys are one contiguous matrix), with no transposing copy.

    Slot 0 is the dummy slot that padded tokens write to and masked positions read from; it is zeroed. The
    rest is left uninitialised: every other slot is written before it is read, and untouched memory is never
    committed by the OS, so a generously sized pool costs only what the run uses.

    Raises:
        BatchgenError: the device cannot allocate the buffers (naming their size).
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.size = size
        shape = (num_layers, num_kv_heads, size + 1, head_dim)
        need = 2 * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self.k_buffer, self.v_buffer = _allocate(
            lambda: (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)),
            f"a KV cache of {size} tokens ({need / 2**30:.1f} GiB on {device}); ask for fewer tokens: a lower "
            "--max-total-tokens (run, bench), or a smaller batch or shorter prompts or outputs (bench-one-batch)",
        )
        self.k_buffer[:, :, 0].zero_()
        self.v_buffer[:, :, 0].zero_()

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K plus V for one token in every layer."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` ``[num_tokens, num_kv_heads, head_dim]`` at slots ``loc`` (int64 ``[num_tokens]``)."""
        self.k_buffer[layer].index_copy_(1, loc, k.transpose(0, 1).to(self.k_buffer.dtype))
        self.v_buffer[layer].index_copy_(1, loc, v.transpose(0, 1).to(self.v_buffer.dtype))


class KVSlotAllocator:
    """Free list of KV slots ``1..size`` (slot 0 is never handed out), with a reference count per slot.

    A slot can belong to several requests: the ``n`` samples of one prompt share its prompt's slots. It returns
    to the free list when the last of them frees it.

    Kept on the CPU: allocation is bookkeeping for the scheduler, and the slots travel to the device inside
    the round's ``out_cache_loc``.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = torch.arange(1, size + 1, dtype=torch.int64)
        self._pending: list[torch.Tensor] = []
        self._refs = torch.zeros(size + 1, dtype=torch.int32)

    def available(self) -> int:
        return int(self._free.numel()) + sum(int(t.numel()) for t in self._pending)

    def alloc(self, n: int) -> torch.Tensor:
        """Take ``n`` free slots (int64 ``[n]``), recently freed ones first so the pool's memory stays warm.

        Raises:
            RuntimeError: when fewer than ``n`` are free.
        """
        if self._pending:
            self._free = torch.cat([*self._pending, self._free])
            self._pending.clear()
        if n > self._free.numel():
            raise RuntimeError(f"KV pool exhausted: asked {n}, {self._free.numel()} free")
        slots, self._free = self._free[:n], self._free[n:]
        self._refs[slots] = 1
        return slots

    def share(self, slots: torch.Tensor, times: int = 1) -> None:
        """Add ``times`` owners to each of ``slots`` (int64 ``[k]``, distinct, all allocated)."""
        self._refs[slots.cpu()] += times

    def free(self, slots: torch.Tensor) -> None:
        """Drop one owner of each of ``slots``; those left with none are merged at the next :meth:`alloc`,
        since requests finish one at a time."""
        if not slots.numel():
            return
        # A copy on the CPU: callers pass views of req_to_token, whose row is reused right away.
        slots = slots.to("cpu", copy=True)
        self._refs[slots] -= 1
        released = slots[self._refs[slots] == 0]
        if released.numel():
            self._pending.append(released)
