"""Attention in plain PyTorch (``scaled_dot_product_attention``) over the paged pool; runs on CPU and GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from batchgen.kernels.attention.base import AttentionBackend

if TYPE_CHECKING:
    from batchgen.loop.forward_batch import ForwardBatch


@dataclass
class _SingleTokenRows:
    """Rows that add one token this round, attended together: a DECODE round, or decodes inside MIXED."""

    token_index: torch.Tensor | None  # int64 [n] rows of q, None when they are all of q in order
    kv_indices: torch.Tensor  # int64 [n, max_len] KV slots, padded with slot 0
    mask: torch.Tensor  # bool [n, 1, max_len]: True where the slot is part of the sequence


@dataclass
class _MultiTokenRow:
    """One request adding several tokens: its queries attend to its whole (prefix + new) sequence."""

    q_start: int
    q_len: int
    kv_indices: torch.Tensor  # int64 [seq_len]
    mask: torch.Tensor | None  # bool [q_len, seq_len], None when there is no prefix (plain causal)


@dataclass
class _Metadata:
    single: _SingleTokenRows | None
    multi: list[_MultiTokenRow]


def _single_token_rows(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    token_index: torch.Tensor | None,
) -> _SingleTokenRows:
    positions = torch.arange(max_len, device=seq_lens.device)
    valid = positions[None, :] < seq_lens[:, None]
    kv_indices = req_to_token[req_pool_indices, :max_len].masked_fill(~valid, 0)
    return _SingleTokenRows(token_index, kv_indices, valid[:, None, :])


class TorchNativeAttnBackend(AttentionBackend):
    """Reference backend: gathers each request's K/V from the pool and calls SDPA.

    DECODE rounds run as one batched SDPA with a length mask (no per-request Python loop, no host sync);
    rows that extend several tokens run one SDPA each, since their shapes differ.
    """

    def __init__(self) -> None:
        self.metadata = _Metadata(None, [])

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        req_to_token = fb.req_to_token_pool.req_to_token
        if fb.forward_mode.is_decode():
            self.metadata = _Metadata(
                _single_token_rows(req_to_token, fb.req_pool_indices, fb.seq_lens, fb.max_seq_len, None), []
            )
            return
        assert fb.extend_seq_lens_cpu is not None and fb.extend_prefix_lens_cpu is not None
        single_rows: list[int] = []
        single_tokens: list[int] = []
        multi: list[_MultiTokenRow] = []
        q_start = 0
        for i, (prefix, extend) in enumerate(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
            if extend == 1:
                single_rows.append(i)
                single_tokens.append(q_start)
            else:
                seq_len = prefix + extend
                kv_indices = req_to_token[fb.req_pool_indices_cpu[i], :seq_len]
                mask = None
                if prefix:
                    q_pos = torch.arange(prefix, seq_len, device=req_to_token.device)
                    mask = torch.arange(seq_len, device=req_to_token.device)[None, :] <= q_pos[:, None]
                multi.append(_MultiTokenRow(q_start, extend, kv_indices, mask))
            q_start += extend
        single: _SingleTokenRows | None = None
        if single_rows:
            device = req_to_token.device
            rows = torch.tensor(single_rows, device=device)
            max_len = max(fb.extend_prefix_lens_cpu[i] + 1 for i in single_rows)
            token_index = torch.tensor(single_tokens, device=device)
            single = _single_token_rows(
                req_to_token, fb.req_pool_indices[rows], fb.seq_lens[rows], max_len, token_index
            )
        self.metadata = _Metadata(single, multi)

    def forward_decode(self, q: torch.Tensor, layer_id: int, forward_batch: ForwardBatch) -> torch.Tensor:
        assert self.metadata.single is not None
        return self._attend_single(q, layer_id, forward_batch, self.metadata.single)

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
        single = self.metadata.single
        if single is not None:
            assert single.token_index is not None
            out[single.token_index] = self._attend_single(q[single.token_index], layer_id, forward_batch, single)
        return out

    @staticmethod
    def _attend_single(
        q: torch.Tensor, layer_id: int, forward_batch: ForwardBatch, rows: _SingleTokenRows
    ) -> torch.Tensor:
        """One query per row against its gathered K/V, with batched matmuls and a float32 softmax.

        Not SDPA: for one query its CPU kernel is ~10x slower than two matmuls, and in float32 it rounds rows
        differently depending on which thread gets them (identical requests got logprobs 1e-6 apart). A
        batched matmul computes every row the same way wherever it sits. In half precision the scores are
        rounded to that precision before the float32 softmax.
        """
        pool = forward_batch.token_to_kv_pool
        n, num_heads, head_dim = q.shape
        num_kv_heads = pool.k_buffer.shape[1]
        max_len = rows.kv_indices.shape[1]
        flat = rows.kv_indices.flatten()
        k = pool.k_buffer[layer_id].index_select(1, flat).view(num_kv_heads, n, max_len, head_dim)
        v = pool.v_buffer[layer_id].index_select(1, flat).view(num_kv_heads, n, max_len, head_dim)
        group = num_heads // num_kv_heads
        qg = q.view(n, num_kv_heads, group, head_dim).transpose(0, 1)  # [Hkv, n, G, D]
        scores = torch.matmul(qg * head_dim**-0.5, k.transpose(-1, -2)).float()  # [Hkv, n, G, max_len]
        probs = torch.softmax(scores.masked_fill(~rows.mask, float("-inf")), dim=-1).to(q.dtype)
        out = torch.matmul(probs, v)  # [Hkv, n, G, D]
        return out.transpose(0, 1).reshape(n, num_heads, head_dim)
