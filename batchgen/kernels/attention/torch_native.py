"""Attention in plain PyTorch (``scaled_dot_product_attention``) over the paged pool; runs on CPU and GPU.

On CPU tensors, rows that add a few tokens (decodes, verify rounds) go to batchgen's C++ paged-attention kernel
when it builds here (:mod:`batchgen.kernels.cpu`): it reads K/V in place, where gathering them copied every
row's whole cache per layer per round. In bfloat16 on an AVX-512 or AVX2 CPU without AMX, or with AMX where
brgemm runs, prefill rows go there too (:func:`~batchgen.kernels.cpu.prefill_rows_supported`), and where brgemm
runs bfloat16 rows run as GEMMs through it (:func:`~batchgen.kernels.cpu.brgemm_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from batchgen.kernels.attention.base import AttentionBackend
from batchgen.kernels.cpu import (
    BrgemmRows,
    brgemm_rows,
    paged_attention,
    paged_attention_available,
    prefill_rows_supported,
)

if TYPE_CHECKING:
    from batchgen.loop.forward_batch import ForwardBatch


# Rows extending at most this many tokens (decodes, verify rounds' K + 1 positions) are attended together,
# padded to the longest of them; longer ones (prefill chunks) run one SDPA each.
SHORT_ROW_TOKENS = 16


@dataclass
class _PaddedRows:
    """Short rows laid out for the gather path: each padded to ``q_len`` query slots and ``max_len`` keys."""

    token_index: torch.Tensor  # int64 [n, q_len] rows of q; padding slots repeat the row's last token
    valid: torch.Tensor  # bool [n, q_len]: False for padding slots (their output is dropped)
    kv_indices: torch.Tensor  # int64 [n, max_len] KV slots, padded with slot 0
    mask: torch.Tensor  # bool [n, q_len, max_len]: key is in the sequence and not after the query


@dataclass
class _ShortRows:
    """Rows that add at most ``SHORT_ROW_TOKENS`` tokens this round: a DECODE round (one each), a TARGET_VERIFY
    round, decodes inside MIXED. Row i's ``q_lens[i]`` new tokens are ``q[q_starts[i]:]``, the last of its
    ``seq_lens[i]`` tokens (all int64 ``[n]``)."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    q_starts: torch.Tensor
    q_lens: torch.Tensor
    padded: _PaddedRows | None  # None when the CPU kernel attends: it needs no padded copies of the indices
    brgemm: BrgemmRows = BrgemmRows.NEVER  # which rows the CPU kernel runs through brgemm


@dataclass
class _MultiTokenRow:
    """One request adding several tokens: its queries attend to its whole (prefix + new) sequence."""

    q_start: int
    q_len: int
    kv_indices: torch.Tensor  # int64 [seq_len]
    mask: torch.Tensor | None  # bool [q_len, seq_len], None when there is no prefix (plain causal)


@dataclass
class _Metadata:
    short: _ShortRows | None
    multi: list[_MultiTokenRow]


def _short_rows(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    max_len: int | None,
    q_len: int,
    brgemm: BrgemmRows = BrgemmRows.NEVER,
) -> _ShortRows:
    """Metadata for rows whose ``q_lens`` new tokens start at ``q_starts`` in q (all int64 ``[n]`` tensors);
    ``max_len`` (the longest ``seq_lens``) only for the gather path, ``None`` for the CPU kernel, which runs the rows
    ``brgemm`` names through brgemm."""
    if max_len is None:
        return _ShortRows(req_pool_indices, seq_lens, q_starts, q_lens, None, brgemm)
    device = seq_lens.device
    slot = torch.arange(q_len, device=device)
    valid = slot[None, :] < q_lens[:, None]
    token_index = q_starts[:, None] + torch.minimum(slot[None, :], q_lens[:, None] - 1)
    # A new token at slot j of a row sits at position seq_len - q_len_row + j.
    q_pos = (seq_lens - q_lens)[:, None] + slot[None, :]
    key_pos = torch.arange(max_len, device=device)
    in_seq = key_pos[None, :] < seq_lens[:, None]
    kv_indices = req_to_token[req_pool_indices, :max_len].masked_fill(~in_seq, 0)
    mask = in_seq[:, None, :] & (key_pos[None, None, :] <= q_pos[:, :, None])
    padded = _PaddedRows(token_index, valid, kv_indices, mask)
    return _ShortRows(req_pool_indices, seq_lens, q_starts, q_lens, padded)


class TorchNativeAttnBackend(AttentionBackend):
    """Reference backend: gathers each request's K/V from the pool and calls SDPA.

    DECODE rounds run as one batched SDPA with a length mask (no per-request Python loop, no host sync);
    rows that extend several tokens run one SDPA each, since their shapes differ. On CPU tensors, short rows
    use the C++ kernel instead when ``cpu_kernel`` and it is available (``BATCHGEN_CPU_ATTENTION_KERNEL=0``
    turns it off), and so do the long ones where :func:`~batchgen.kernels.cpu.prefill_rows_supported` says it is
    the faster. With ``deterministic`` every row goes to the kernel, through brgemm for every row where it
    runs (:class:`~batchgen.kernels.cpu.BrgemmRows`), else on its vector path, so a query's result is the same in a
    prefill chunk of any size as in a decode.
    """

    def __init__(self, cpu_kernel: bool = True, deterministic: bool = False) -> None:
        self.cpu_kernel = cpu_kernel
        self.deterministic = deterministic
        self.metadata = _Metadata(None, [])

    def kernel_brgemm(self, dtype: torch.dtype, head_dim: int) -> BrgemmRows:
        """The rows the C++ kernel runs through brgemm for a pool of ``dtype`` and ``head_dim``, as this backend
        asks it (:func:`~batchgen.kernels.cpu.brgemm_rows`; every row under ``deterministic``)."""
        return brgemm_rows(dtype, head_dim, self.deterministic)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        req_to_token = fb.req_to_token_pool.req_to_token
        # A lookup once built; asked here so that a CUDA run never builds the CPU kernel.
        gather = req_to_token.device.type != "cpu" or not (self.cpu_kernel and paged_attention_available())
        pool = fb.token_to_kv_pool.k_buffer
        brgemm = BrgemmRows.NEVER if gather else self.kernel_brgemm(pool.dtype, pool.shape[-1])
        if fb.forward_mode.is_decode():
            ones = torch.ones_like(fb.seq_lens)
            max_len = fb.max_seq_len if gather else None
            decodes = _short_rows(
                req_to_token, fb.req_pool_indices, fb.seq_lens, ones.cumsum(0) - 1, ones, max_len, 1, brgemm
            )
            self.metadata = _Metadata(decodes, [])
            return
        assert fb.extend_seq_lens_cpu is not None and fb.extend_prefix_lens_cpu is not None
        all_rows_in_kernel = not gather and (self.deterministic or prefill_rows_supported(pool.dtype, pool.shape[-1]))
        short_rows: list[int] = []
        short_starts: list[int] = []
        multi: list[_MultiTokenRow] = []
        q_start = 0
        for i, (prefix, extend) in enumerate(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
            if extend <= SHORT_ROW_TOKENS or all_rows_in_kernel:
                short_rows.append(i)
                short_starts.append(q_start)
            else:
                seq_len = prefix + extend
                kv_indices = req_to_token[fb.req_pool_indices_cpu[i], :seq_len]
                mask = None
                if prefix:
                    q_pos = torch.arange(prefix, seq_len, device=req_to_token.device)
                    mask = torch.arange(seq_len, device=req_to_token.device)[None, :] <= q_pos[:, None]
                multi.append(_MultiTokenRow(q_start, extend, kv_indices, mask))
            q_start += extend
        short: _ShortRows | None = None
        if short_rows:
            device = req_to_token.device
            rows = torch.tensor(short_rows, device=device)
            lens = [fb.extend_seq_lens_cpu[i] for i in short_rows]
            max_len = max(fb.extend_prefix_lens_cpu[i] + fb.extend_seq_lens_cpu[i] for i in short_rows)
            short = _short_rows(
                req_to_token,
                fb.req_pool_indices[rows],
                fb.seq_lens[rows],
                torch.tensor(short_starts, device=device),
                torch.tensor(lens, device=device),
                max_len if gather else None,
                max(lens),
                brgemm,
            )
        self.metadata = _Metadata(short, multi)

    def forward_decode(self, q: torch.Tensor, layer_id: int, forward_batch: ForwardBatch) -> torch.Tensor:
        short = self.metadata.short
        assert short is not None
        if short.padded is None:
            return self._attend_in_place(q, layer_id, forward_batch, short, torch.empty_like(q))
        return self._attend_short(q, layer_id, forward_batch, short.padded)

    def forward_extend(self, q: torch.Tensor, layer_id: int, forward_batch: ForwardBatch) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        k_buffer, v_buffer = pool.k_buffer[layer_id], pool.v_buffer[layer_id]
        out = torch.empty_like(q)
        for row in self.metadata.multi:
            q_row = q[row.q_start : row.q_start + row.q_len].transpose(0, 1).unsqueeze(0)
            k_row = k_buffer.index_select(1, row.kv_indices).unsqueeze(0)  # [1, Hkv, seq_len, D]
            v_row = v_buffer.index_select(1, row.kv_indices).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                q_row, k_row, v_row, attn_mask=row.mask, is_causal=row.mask is None, enable_gqa=True
            )
            out[row.q_start : row.q_start + row.q_len] = o.squeeze(0).transpose(0, 1)
        short = self.metadata.short
        padded = short.padded if short is not None else None
        if padded is not None:
            attended = self._attend_short(q, layer_id, forward_batch, padded)
            out[padded.token_index[padded.valid]] = attended[padded.valid.flatten()]
        elif short is not None:
            self._attend_in_place(q, layer_id, forward_batch, short, out)
        return out

    @staticmethod
    def _attend_in_place(
        q: torch.Tensor, layer_id: int, forward_batch: ForwardBatch, rows: _ShortRows, out: torch.Tensor
    ) -> torch.Tensor:
        """Writes the short rows' tokens of ``out`` ``[T, num_heads, head_dim]`` with the CPU kernel, which reads
        each row's K/V where they lie in the pool: float32 accumulation (in half precision, the probabilities
        rounded to it before weighting V, as SDPA does), each row computed alike in any batch on its path; through
        brgemm where the rows say so. Returns ``out``."""
        pool = forward_batch.token_to_kv_pool
        return paged_attention(
            q,
            pool.k_buffer[layer_id],
            pool.v_buffer[layer_id],
            forward_batch.req_to_token_pool.req_to_token,
            rows.req_pool_indices,
            rows.seq_lens,
            rows.q_starts,
            rows.q_lens,
            q.shape[-1] ** -0.5,
            out,
            rows.brgemm,
        )

    @staticmethod
    def _attend_short(q: torch.Tensor, layer_id: int, forward_batch: ForwardBatch, rows: _PaddedRows) -> torch.Tensor:
        """Each row's ``q_len`` query slots against its gathered K/V, with batched matmuls and a float32 softmax
        (the GPU path, and the CPU's when the C++ kernel is off or did not build).

        Returns ``[n * q_len, num_heads, head_dim]``, slot-major within each row. Not SDPA: for a few queries
        its CPU kernel is ~10x slower than two matmuls, and in float32 it rounds rows differently depending on
        which thread gets them (identical requests got logprobs 1e-6 apart). A batched matmul computes every
        row the same way wherever it sits. In half precision the scores are rounded to that precision before
        the float32 softmax.
        """
        pool = forward_batch.token_to_kv_pool
        n, q_len = rows.token_index.shape
        _, num_heads, head_dim = q.shape
        num_kv_heads = pool.k_buffer.shape[1]
        group = num_heads // num_kv_heads
        max_len = rows.kv_indices.shape[1]
        flat = rows.kv_indices.flatten()
        k = pool.k_buffer[layer_id].index_select(1, flat).view(num_kv_heads, n, max_len, head_dim)
        v = pool.v_buffer[layer_id].index_select(1, flat).view(num_kv_heads, n, max_len, head_dim)
        # A DECODE round's queries are already one per row, in order.
        queries = q if q_len == 1 and q.shape[0] == n else q[rows.token_index.flatten()]
        # [n, q_len, Hkv, G, D] → [Hkv, n, G * q_len, D]: a row's query slots and grouped heads share its K/V.
        qg = queries.view(n, q_len, num_kv_heads, group, head_dim).permute(2, 0, 3, 1, 4)
        qg = qg.reshape(num_kv_heads, n, group * q_len, head_dim)
        scores = torch.matmul(qg * head_dim**-0.5, k.transpose(-1, -2)).float()  # [Hkv, n, G * q_len, max_len]
        mask = rows.mask[:, None].expand(n, group, q_len, max_len).reshape(n, group * q_len, max_len)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
        out = torch.matmul(probs, v).view(num_kv_heads, n, group, q_len, head_dim)
        return out.permute(1, 3, 0, 2, 4).reshape(n * q_len, num_heads, head_dim)
