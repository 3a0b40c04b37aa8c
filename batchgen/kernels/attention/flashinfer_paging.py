"""FlashInfer's page tables and workspace size for batchgen's pool (page size 1); no flashinfer import needed.

KV layout. The pool keeps each layer head-major, ``[num_kv_heads, slots, head_dim]``. FlashInfer 0.5 reads a paged
cache through the tensors' own strides (``paged_kv_t``'s custom-stride constructor in
``include/flashinfer/page.cuh``, fed by ``paged_k_cache.strides()`` in ``csrc/batch_prefill.cu`` and
``csrc/batch_decode.cu``; only the last dimension must be dense), so each layer is passed without a copy as the
view ``k_buffer[layer].transpose(0, 1).unsqueeze(1)``: NHD ``[slots, page_size=1, num_kv_heads, head_dim]``
with strides ``(head_dim, *, slots * head_dim, 1)``. That holds for the FA2 kernels only: the FA3 (SM90) prefill
path converts page strides to offsets as ``stride_page // stride_n`` (``BatchPrefillWithPagedKVCacheWrapper.run``
in ``flashinfer/prefill.py``), which is 0 for this view, so both wrappers are pinned to ``backend="fa2"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchgen.errors import BatchgenError

MIN_WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace
_MAX_STRIDE = 2**32  # paged_kv_t keeps strides as uint32


@dataclass
class PagedKVIndex:
    """One round's page table in FlashInfer's CSR form, page size 1.

    Attributes:
        kv_indptr: int32 ``[bs + 1]`` on the host; request ``i`` owns ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``.
        kv_indices: int32 ``[kv_indptr[-1]]`` on the pool's device: each request's ``req_to_token`` row cut to its
            sequence length, requests back to back.
        kv_last_page_len: int32 ``[bs]`` on the host, all ones: with one slot per page every page is full.

    ``plan()`` reads the indptr and last-page lengths on the host (it calls ``.to("cpu")`` on them), so they are
    built there: a device tensor would cost a device-to-host copy and a sync in every plan.
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


def indptr_from_lengths(lengths: Sequence[int]) -> torch.Tensor:
    """int32 ``[len(lengths) + 1]`` on the host: ``0`` then the running sums (FlashInfer's ``*_indptr``)."""
    indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        indptr[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0, dtype=torch.int32)
    return indptr


def gather_kv_indices(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, total: int
) -> torch.Tensor:
    """``req_to_token[req_pool_indices[i], :seq_lens[i]]`` for every ``i``, concatenated, as int32 ``[total]``.

    Args:
        req_to_token: int64 ``[rows, max_context_len]``.
        req_pool_indices, seq_lens: int64 ``[bs]`` on ``req_to_token``'s device.
        total: ``sum(seq_lens)``, known on the host, so that no step waits for the device.
    """
    device = req_to_token.device
    rows = torch.repeat_interleave(torch.arange(seq_lens.numel(), device=device), seq_lens, output_size=total)
    starts = torch.cumsum(seq_lens, 0) - seq_lens  # where each request's slots begin in the flat list
    positions = torch.arange(total, device=device) - starts[rows]
    return req_to_token[req_pool_indices[rows], positions].to(torch.int32)


def build_paged_kv_index(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, seq_lens_host: Sequence[int]
) -> PagedKVIndex:
    """The page table of requests ``req_pool_indices`` with ``seq_lens`` (``seq_lens_host``: the same, on the host)."""
    kv_indptr = indptr_from_lengths(seq_lens_host)
    kv_indices = gather_kv_indices(req_to_token, req_pool_indices, seq_lens, int(kv_indptr[-1]))
    return PagedKVIndex(kv_indptr, kv_indices, torch.ones(len(seq_lens_host), dtype=torch.int32))


def paged_kv_views(k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer of the head-major pool ``[num_layers, num_kv_heads, slots, head_dim]`` as FlashInfer's NHD paged
    cache ``[slots, 1, num_kv_heads, head_dim]`` (page size 1): views, sharing memory with the buffers.

    Raises:
        BatchgenError: the pool's page stride (``slots * head_dim``) does not fit FlashInfer's 32-bit strides.
    """
    slots, head_dim = k_buffer.shape[2], k_buffer.shape[3]
    if slots * head_dim >= _MAX_STRIDE:
        raise BatchgenError(
            f"--attention-backend flashinfer: a KV pool of {slots} slots is too large for its 32-bit "
            "strides; lower --max-total-tokens"
        )
    return [(k.transpose(0, 1).unsqueeze(1), v.transpose(0, 1).unsqueeze(1)) for k, v in zip(k_buffer, v_buffer)]


def _fa2_cta_tile_q(packed_qo_len: int, head_dim: int, ampere_or_newer: bool) -> int:
    """Query rows per thread block of FlashInfer's FA2 kernels (``FA2DetermineCtaTileQ``, utils.cuh): before SM80
    (Turing) never fewer than 64, for lack of shared memory."""
    if packed_qo_len > 64 and head_dim < 256:
        return 128
    return 64 if packed_qo_len > 16 or not ampere_or_newer else 16


def workspace_bytes(
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_sms: int,
    max_graph_bs: int = 0,
    graph_tokens: int = 1,
    ampere_or_newer: bool = True,
) -> int:
    """Float workspace large enough for every plan the backend makes (at least 128 MiB).

    FlashInfer's FA2 plan (``PrefillPlan`` / ``PrefillSplitQOKVIndptr`` in
    ``include/flashinfer/attention/scheduler.cuh``) fails when the split-KV partial results do not fit:
    ``num_qo_heads * tiles * cta_tile_q * (head_dim + 1) * 4`` bytes. Eager plans split only up to
    ``2 * num_sms // num_kv_heads`` tiles. A CUDA-graph plan of ``bs`` requests with ``graph_tokens`` queries each
    (1 for DECODE, K + 1 for TARGET_VERIFY), ``rows = bs * graph_tokens`` in all, sizes its tiles for the longest
    request those rows allow: ``cta_tile_q`` is chosen for ``(rows - bs + 1) * group`` packed queries and it
    reserves ``max(eager tiles, ceil(rows * group / cta_tile_q) + bs - 1)`` tiles. Every graph size up to
    ``max_graph_bs`` is captured, so the largest need among them counts. 128 MiB covers Llama-1B's DECODE graphs
    up to batch ~800, but neither its batch-256 verify graphs with 4 drafts (~314 MB) nor 64 query heads of 128
    at batch 256, hence the computation. ``ampere_or_newer``: the GPU's compute capability is 8.0 or more
    (older ones use larger tiles, see :func:`_fa2_cta_tile_q`).
    """
    group = num_qo_heads // num_kv_heads
    split_tiles = (2 * num_sms) // num_kv_heads
    need = num_qo_heads * split_tiles * 128 * (head_dim + 1) * 4  # cta_tile_q is at most 128
    for bs in range(1, max_graph_bs + 1):
        rows = bs * graph_tokens
        cta = _fa2_cta_tile_q((rows - bs + 1) * group, head_dim, ampere_or_newer)
        tiles = max(split_tiles, -(-rows * group // cta) + bs - 1)
        need = max(need, num_qo_heads * tiles * cta * (head_dim + 1) * 4)
    return max(MIN_WORKSPACE_BYTES, (need + (2 << 20)) & ~((1 << 20) - 1))  # + slack for alignment, whole MiB
