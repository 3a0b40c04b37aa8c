"""The interface every attention backend implements, over the paged KV pool."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from batchgen.loop.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Computes attention for one round, reading K/V of earlier tokens from ``forward_batch.token_to_kv_pool``.

    Per round, :meth:`init_forward_metadata` turns the batch's index tensors (``req_pool_indices``,
    ``seq_lens``, extend lengths) into whatever the kernels need, once for all layers. Per layer,
    :meth:`forward` stores the new tokens' K/V at ``out_cache_loc`` and attends: causal within each request's
    new tokens, full over its cached prefix.

    CUDA graphs: a backend whose DECODE rounds read only the ForwardBatch's device tensors (``req_pool_indices``,
    ``seq_lens``, ``out_cache_loc``), never a host value such as ``max_seq_len``, and whose launch grids depend
    only on the batch size, sets ``supports_cuda_graph``; the graph runner then captures one graph per batch
    size and, before each replay, lets the backend refresh its static metadata outside the graph. Such a
    backend also captures TARGET_VERIFY rounds with a fixed number of tokens per request (K + 1).
    """

    supports_cuda_graph: ClassVar[bool] = False

    def init_cuda_graph_state(self, max_bs: int, verify_tokens: int = 0) -> None:
        """Allocate the static buffers captured graphs read, for up to ``max_bs`` rows (once, pre-capture): DECODE
        rounds, and with ``verify_tokens`` > 0 TARGET_VERIFY rounds of that many tokens per request."""
        return None  # backends without static buffers need nothing here

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        """Metadata for capturing a DECODE or TARGET_VERIFY round of ``forward_batch.batch_size`` rows; by
        default as eager."""
        self.init_forward_metadata(forward_batch)

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        """Refresh the static metadata before replaying a captured round (runs outside the graph)."""
        self.init_forward_metadata(forward_batch)

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Prepare per-round metadata; called by ``ForwardBatch.init_new`` before the model runs."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer_id: int,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """Attention output ``[T, num_heads, head_dim]`` for q ``[T, num_heads, head_dim]``.

        k, v: ``[T, num_kv_heads, head_dim]``, the new tokens' keys and values, stored into the pool first; both
        ``None`` when the model stored them already (:meth:`batchgen.models.llama.LlamaForCausalLM.store_kv_in_rope`).
        """
        if k is not None and v is not None:
            self.store_kv(k, v, layer_id, forward_batch)
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, layer_id, forward_batch)
        return self.forward_extend(q, layer_id, forward_batch)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer_id: int, forward_batch: ForwardBatch) -> None:
        """Write the new tokens' ``k``, ``v`` ``[T, num_kv_heads, head_dim]`` at ``out_cache_loc`` of layer
        ``layer_id``'s pool; torch's index copies unless a backend has a kernel for it."""
        forward_batch.token_to_kv_pool.set_kv(layer_id, forward_batch.out_cache_loc, k, v)

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, layer_id: int, forward_batch: ForwardBatch) -> torch.Tensor:
        """EXTEND/MIXED rounds: each request appends ``extend_seq_lens[i]`` tokens after a cached prefix."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, layer_id: int, forward_batch: ForwardBatch) -> torch.Tensor:
        """DECODE rounds: one query token per request, ``q`` is ``[batch_size, num_heads, head_dim]``."""
