"""Attention backend running batchgen's own Triton kernels over the paged KV pool.

Importing this module imports ``triton``; :func:`batchgen.kernels.attention.create_attention_backend`
does so only when the ``triton`` backend is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from batchgen.errors import BatchgenError
from batchgen.kernels.attention.base import AttentionBackend
from batchgen.kernels.triton import decode_attention, extend_attention, kv_store

if TYPE_CHECKING:
    from batchgen.loop.forward_batch import ForwardBatch

DEFAULT_NUM_KV_SPLITS = 8


@dataclass
class _DecodeMetadata:
    """A DECODE round's split scratch, allocated by its first layer (the head count comes with ``q``)."""

    mid_o: torch.Tensor | None = None  # float32 [batch, num_heads, num_kv_splits, head_dim]
    mid_lse: torch.Tensor | None = None  # float32 [batch, num_heads, num_kv_splits]


@dataclass
class _ExtendMetadata:
    """An EXTEND/MIXED round's per-request lengths on the device (int64 ``[batch]`` each)."""

    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    qo_start: torch.Tensor  # first row of each request in q: exclusive prefix sum of extend_lens
    max_extend_len: int  # host int: sizes the extend grid


def _extend_lengths(fb: ForwardBatch) -> tuple[torch.Tensor, int]:
    """Host int64 ``[3, batch]``: prefix lengths, new-token counts and q offsets; and the longest extend.

    Raises:
        ValueError: for a round without ``extend_*_cpu`` lengths.
    """
    if fb.extend_seq_lens_cpu is None or fb.extend_prefix_lens_cpu is None:
        raise ValueError(f"{fb.forward_mode.name} round without extend lengths")
    extend_lens = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64)
    prefix_lens = torch.tensor(fb.extend_prefix_lens_cpu, dtype=torch.int64)
    qo_start = extend_lens.cumsum(0) - extend_lens
    return torch.stack([prefix_lens, extend_lens, qo_start]), max(fb.extend_seq_lens_cpu, default=0)


def _one_token_lengths(seq_lens: torch.Tensor) -> torch.Tensor:
    """int64 ``[3, batch]`` on ``seq_lens``' device: a DECODE round as an extend of one token per request (prefix
    lengths ``seq_lens - 1``, new-token counts 1, q offsets ``0..batch-1``), computed there without a host sync."""
    return torch.stack([seq_lens - 1, torch.ones_like(seq_lens), torch.arange(len(seq_lens), device=seq_lens.device)])


class TritonAttnBackend(AttentionBackend):
    """Attention with the Triton kernels of :mod:`batchgen.kernels.triton`.

    DECODE rounds run Flash-Decoding split-K (:func:`decode_attention.decode_attention_fwd`) with a fixed
    ``num_kv_splits``; EXTEND and MIXED rounds run the FlashAttention-2 style
    :func:`extend_attention.extend_attention_fwd`, decoding rows of a MIXED round included. Both read K/V
    in place from the pool, after :func:`kv_store.store_kv` has written the new tokens' K/V. Outputs have q's dtype
    (float32, bfloat16 or float16, the pool's dtype).

    CUDA graphs: a DECODE round reads only ``req_pool_indices``, ``seq_lens`` (and, in the base class,
    ``out_cache_loc``) on the device, and its grids depend only on the batch size. A TARGET_VERIFY round of K + 1
    tokens per request reads its lengths from a static buffer refreshed before each replay. After
    :meth:`init_cuda_graph_state`, rounds of up to ``max_bs`` rows share one static scratch buffer, so captured
    graphs keep pointing at live memory; it is allocated by the first DECODE forward (the eager warm-up before
    capture), because the interface gives the query head count only with ``q``.

    ``deterministic`` (``--deterministic``): DECODE rounds run the extend kernel too, as an extend of one token per
    request after ``seq_lens - 1`` cached ones (lengths derived on the device; a static buffer under CUDA graphs),
    so that a query's output has the same bits whether it is decoded, verified or part of any prefill chunk: one
    compiled kernel, the same key blocks and tiles (Flash-Decoding's slices follow the sequence length, and its
    products have other tile shapes). Its grid ``(batch, num_heads, 1)`` depends only on the batch size.

    Args:
        device: where the pool lives: ``cuda``, or ``cpu`` under Triton's interpreter (``TRITON_INTERPRET=1``).
        num_kv_splits: slices of each sequence in a DECODE round (Flash-Decoding's split count); a constant
            of the backend, so a captured graph's split count never goes stale.
        deterministic: batch-invariant DECODE rounds, as above.

    Raises:
        BatchgenError: on a CPU device when the kernels were not loaded in interpreter mode.
        ValueError: when ``num_kv_splits`` < 1.
    """

    supports_cuda_graph: ClassVar[bool] = True

    def __init__(
        self, device: torch.device, num_kv_splits: int = DEFAULT_NUM_KV_SPLITS, deterministic: bool = False
    ) -> None:
        if num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
        if device.type == "cpu" and not (decode_attention.INTERPRETED and extend_attention.INTERPRETED):
            raise BatchgenError(
                "attention backend 'triton' on the CPU needs TRITON_INTERPRET=1 set before batchgen's Triton "
                "kernels are first imported"
            )
        self.device = device
        self.num_kv_splits = num_kv_splits
        self.deterministic = deterministic
        self._graph_max_bs: int | None = None
        self._graph_scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._graph_extend: torch.Tensor | None = None
        self._graph_decode: torch.Tensor | None = None
        self._decode = _DecodeMetadata()
        self._extend: _ExtendMetadata | None = None

    def init_cuda_graph_state(self, max_bs: int, verify_tokens: int = 0) -> None:
        """Reserve the DECODE scratch for graphs of up to ``max_bs`` rows (allocated at the first decode), and
        with ``verify_tokens`` the static per-request lengths that captured TARGET_VERIFY rounds read."""
        self._graph_max_bs = max_bs
        self._graph_scratch = None
        self._graph_extend = torch.zeros(3, max_bs, dtype=torch.int64, device=self.device) if verify_tokens else None
        ones = torch.ones(max_bs, dtype=torch.int64, device=self.device)
        self._graph_decode = _one_token_lengths(ones) if self.deterministic else None

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        self._init_graph_metadata(forward_batch)

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        self._init_graph_metadata(forward_batch)

    def _init_graph_metadata(self, forward_batch: ForwardBatch) -> None:
        """As :meth:`init_forward_metadata`, but a TARGET_VERIFY round's lengths go into the static buffer, whose
        address the captured extend kernel keeps (its grid depends only on the batch size and K + 1)."""
        fb = forward_batch
        if fb.forward_mode.is_decode() and self.deterministic:
            if self._graph_decode is None or fb.batch_size > self._graph_decode.shape[1]:
                raise RuntimeError(f"DECODE graph of {fb.batch_size} rows without init_cuda_graph_state for it")
            static = self._graph_decode[:, : fb.batch_size]
            torch.sub(fb.seq_lens, 1, out=static[0])  # rows 1 and 2 (ones, 0..max_bs-1) never change
            self._extend = _ExtendMetadata(static[0], static[1], static[2], 1)
            return
        if not fb.forward_mode.is_target_verify():
            self.init_forward_metadata(fb)
            return
        if self._graph_extend is None or fb.batch_size > self._graph_extend.shape[1]:
            raise RuntimeError(f"TARGET_VERIFY graph of {fb.batch_size} rows without init_cuda_graph_state for it")
        lens, max_extend_len = _extend_lengths(fb)
        static = self._graph_extend[:, : fb.batch_size]
        static.copy_(lens, non_blocking=True)
        self._extend = _ExtendMetadata(static[0], static[1], static[2], max_extend_len)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """DECODE: nothing but a fresh scratch slot (the kernels read lengths on the device). EXTEND/MIXED:
        the per-request prefix lengths, new-token counts and q offsets, copied to the device once.

        Raises:
            ValueError: for a non-DECODE round without ``extend_*_cpu`` lengths.
        """
        fb = forward_batch
        if fb.forward_mode.is_decode():
            self._decode = _DecodeMetadata()
            self._extend = None
            if self.deterministic:
                lens = _one_token_lengths(fb.seq_lens)
                self._extend = _ExtendMetadata(lens[0], lens[1], lens[2], 1)
            return
        host_lens, max_extend_len = _extend_lengths(fb)
        # One host-to-device copy for all three.
        lens = host_lens.to(fb.seq_lens.device, non_blocking=True)
        self._extend = _ExtendMetadata(lens[0], lens[1], lens[2], max_extend_len)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer_id: int, forward_batch: ForwardBatch) -> None:
        """As the base class, with one Triton kernel instead of torch's index copies."""
        pool = forward_batch.token_to_kv_pool
        kv_store.store_kv(pool.k_buffer[layer_id], pool.v_buffer[layer_id], forward_batch.out_cache_loc, k, v)

    def forward_decode(self, q: torch.Tensor, layer_id: int, forward_batch: ForwardBatch) -> torch.Tensor:
        """``[batch, num_heads, head_dim]`` output for one query per request; reads only device tensors."""
        if self.deterministic:
            return self.forward_extend(q, layer_id, forward_batch)
        pool = forward_batch.token_to_kv_pool
        q = q.contiguous()
        mid_o, mid_lse = self._decode_scratch(q)
        out = torch.empty_like(q)
        return decode_attention.decode_attention_fwd(
            q,
            pool.k_buffer[layer_id],
            pool.v_buffer[layer_id],
            out,
            forward_batch.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            mid_o,
            mid_lse,
            self.num_kv_splits,
        )

    def forward_extend(self, q: torch.Tensor, layer_id: int, forward_batch: ForwardBatch) -> torch.Tensor:
        """``[T, num_heads, head_dim]`` output for an EXTEND/MIXED round's ``T`` new tokens.

        Raises:
            RuntimeError: when the round's metadata was not prepared by :meth:`init_forward_metadata`.
        """
        md = self._extend
        if md is None:
            raise RuntimeError("forward_extend before init_forward_metadata of an EXTEND/MIXED round")
        pool = forward_batch.token_to_kv_pool
        q = q.contiguous()
        out = torch.empty_like(q)
        return extend_attention.extend_attention_fwd(
            q,
            pool.k_buffer[layer_id],
            pool.v_buffer[layer_id],
            out,
            forward_batch.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            md.prefix_lens,
            md.extend_lens,
            md.qo_start,
            md.max_extend_len,
        )

    def _decode_scratch(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Split scratch for q's rows: views of the static buffer in graph mode, else one per round."""
        batch, num_heads, head_dim = q.shape
        shape = (num_heads, self.num_kv_splits, head_dim)
        if self._graph_max_bs is not None and batch <= self._graph_max_bs:
            if self._graph_scratch is None or self._graph_scratch[0].shape[1:] != shape:
                self._graph_scratch = decode_attention.decode_scratch(
                    self._graph_max_bs, num_heads, head_dim, self.num_kv_splits, q.device
                )
            mid_o, mid_lse = self._graph_scratch
            return mid_o[:batch], mid_lse[:batch]
        md = self._decode
        if md.mid_o is None or md.mid_lse is None or md.mid_o.shape != (batch, *shape):
            md.mid_o, md.mid_lse = decode_attention.decode_scratch(
                batch, num_heads, head_dim, self.num_kv_splits, q.device
            )
        return md.mid_o, md.mid_lse
