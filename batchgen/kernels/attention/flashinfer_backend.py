"""Attention with FlashInfer (flashinfer-python 0.5.x) over the paged pool: CUDA only, float16/bfloat16 only.

Each round is planned once, in :meth:`FlashInferAttnBackend.init_forward_metadata`, from ``req_to_token`` with page
size 1 (a page is one KV slot); every layer then runs the planned wrapper:

- DECODE: ``BatchDecodeWithPagedKVCacheWrapper``, on its tensor-core path (the FA2 prefill kernel with one query
  per request): faster than the CUDA-core kernel once several query heads share a KV head, and it is the same
  JIT module as the prefill wrapper's, so a fresh machine compiles one module per dtype and head size, not two.
- EXTEND/MIXED: ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True``. FlashInfer aligns the causal mask
  to the end of each request's KV, so the query at position ``prefix + i`` sees KV ``0 .. prefix + i``: the cached
  prefix and the new tokens up to itself; a MIXED decode row (one query) sees its whole sequence.

KV layout and why both wrappers are pinned to FA2: :mod:`batchgen.kernels.attention.flashinfer_paging`.

Imported without flashinfer or CUDA; :class:`FlashInferAttnBackend` imports flashinfer when constructed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from batchgen.errors import BatchgenError
from batchgen.kernels.attention.base import AttentionBackend
from batchgen.kernels.attention.flashinfer_paging import (
    PagedKVIndex,
    build_paged_kv_index,
    indptr_from_lengths,
    paged_kv_views,
    workspace_bytes,
)
from batchgen.kernels.attention.flashinfer_support import unavailable_reason

if TYPE_CHECKING:
    from batchgen.loop.forward_batch import ForwardBatch
    from batchgen.loop.kv_pool import TokenToKVPool

_KV_LAYOUT = "NHD"
_KERNELS = "fa2"  # FA3 misreads the strided pool view (flashinfer_paging's docstring)
_PAGE_SIZE = 1


class FlashInferAttnBackend(AttentionBackend):
    """FlashInfer's paged-KV prefill and decode kernels, planned once per round; DECODE rounds capturable.

    Args:
        device: a CUDA device.
        dtype: the model's (and the KV pool's) dtype, float16 or bfloat16.
        num_qo_heads, num_kv_heads, head_dim: the model's attention shape.

    Raises:
        BatchgenError: not a CUDA device, float32, an unsupported head size, or flashinfer cannot be imported.
    """

    supports_cuda_graph = True

    def __init__(
        self, device: torch.device, dtype: torch.dtype, num_qo_heads: int, num_kv_heads: int, head_dim: int
    ) -> None:
        reason = unavailable_reason(device, dtype, num_qo_heads, num_kv_heads, head_dim)
        if reason is not None:
            raise BatchgenError(reason)
        import flashinfer

        self._flashinfer: Any = flashinfer
        self.device = device
        self.dtype = dtype
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sm_scale = 1.0 / math.sqrt(head_dim)  # as the reference backend; passed explicitly, not defaulted
        properties = torch.cuda.get_device_properties(device)
        self._num_sms = properties.multi_processor_count
        self._ampere_or_newer = properties.major >= 8
        self._allocate_workspace(
            workspace_bytes(num_qo_heads, num_kv_heads, head_dim, self._num_sms, ampere_or_newer=self._ampere_or_newer)
        )
        self._build_kernels()
        # What forward_decode / forward_extend run: the eager wrappers or a captured graph's.
        self._decode: Any = self._eager_decode
        self._extend: Any = self._prefill
        # CUDA graphs: static page-table buffers shared by one wrapper per captured mode and batch size.
        self._graph_max_bs = 0
        self._graph_kv_indptr: torch.Tensor | None = None
        self._graph_kv_last_page_len: torch.Tensor | None = None
        self._graph_kv_indices: torch.Tensor | None = None
        self._graph_qo_indptr: torch.Tensor | None = None
        self._graph_decode: dict[int, Any] = {}
        self._graph_verify: dict[int, Any] = {}
        self._kv_views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._kv_views_of: tuple[object, ...] = ()

    def _allocate_workspace(self, size: int) -> None:
        """(Re)allocate the float workspace and the eager wrappers that use it."""
        # FlashInfer requires the workspace zeroed before its first use; the wrappers share it, since one
        # attention call runs at a time on the stream.
        self._workspace = torch.zeros(size, dtype=torch.uint8, device=self.device)
        fi = self._flashinfer
        self._eager_decode = fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, _KV_LAYOUT, use_tensor_cores=True, backend=_KERNELS
        )
        self._prefill = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, _KV_LAYOUT, backend=_KERNELS)

    def _build_kernels(self) -> None:
        """Plan a one-token batch now: FlashInfer JIT-builds (or loads from its cache) the kernels of this dtype
        and head size on first use, so a build failure is a one-line error at startup, not a crash mid-run.
        Both wrappers share the one module (the tensor-core decode path runs the FA2 prefill kernels)."""
        one = indptr_from_lengths([1])
        slot0 = torch.zeros(1, dtype=torch.int32, device=self.device)
        try:
            self._plan_prefill(self._prefill, one, PagedKVIndex(one, slot0, torch.ones(1, dtype=torch.int32)))
        except Exception as e:  # ninja/nvcc failures arrive as RuntimeError with the whole build log
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise BatchgenError(
                "--attention-backend flashinfer could not build its kernels (compiled with nvcc and ninja on "
                f"first use, cached in ~/.cache/flashinfer): {detail}"
            ) from e

    # ---- planning (host side, once per round) ----

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        if fb.forward_mode.is_decode():
            self._plan_decode(self._eager_decode, fb)
            self._decode = self._eager_decode
        else:
            self._plan_extend(self._prefill, fb)
            self._extend = self._prefill

    def _plan_extend(self, wrapper: Any, fb: ForwardBatch) -> None:
        assert fb.extend_seq_lens_cpu is not None and fb.extend_prefix_lens_cpu is not None
        extend = fb.extend_seq_lens_cpu
        seq_lens_host = [p + e for p, e in zip(fb.extend_prefix_lens_cpu, extend)]
        index = build_paged_kv_index(fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, seq_lens_host)
        self._plan_prefill(wrapper, indptr_from_lengths(extend), index)

    def _plan_prefill(self, wrapper: Any, qo_indptr: torch.Tensor, index: PagedKVIndex) -> None:
        wrapper.plan(
            qo_indptr,
            index.kv_indptr,
            index.kv_indices,
            index.kv_last_page_len,
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            _PAGE_SIZE,
            causal=True,
            pos_encoding_mode="NONE",  # RoPE is applied by the model before attention
            sm_scale=self.sm_scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )

    def _plan_decode(self, wrapper: Any, fb: ForwardBatch) -> None:
        # The one device-to-host copy of a DECODE round: FlashInfer plans on the host and DECODE batches carry
        # no host copy of their lengths. Never inside a graph capture: plan() itself copies to the host.
        seq_lens_host = fb.seq_lens.tolist()
        index = build_paged_kv_index(fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, seq_lens_host)
        wrapper.plan(
            index.kv_indptr,
            index.kv_indices,
            index.kv_last_page_len,
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            _PAGE_SIZE,
            pos_encoding_mode="NONE",
            sm_scale=self.sm_scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )

    # ---- CUDA graphs (DECODE, and TARGET_VERIFY with K + 1 tokens per request) ----

    def init_cuda_graph_state(self, max_bs: int, verify_tokens: int = 0) -> None:
        if self._graph_decode or self._graph_verify:
            # A larger workspace would leave the captured graphs pointing into the freed one.
            raise RuntimeError("init_cuda_graph_state after graphs were captured")
        self._graph_max_bs = max_bs
        needed = max(
            workspace_bytes(
                self.num_qo_heads,
                self.num_kv_heads,
                self.head_dim,
                self._num_sms,
                max_bs,
                tokens,
                ampere_or_newer=self._ampere_or_newer,
            )
            for tokens in ((1, verify_tokens) if verify_tokens else (1,))
        )
        if needed > self._workspace.numel():
            self._allocate_workspace(needed)
            self._decode, self._extend = self._eager_decode, self._prefill
        self._graph_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_kv_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        self._graph_kv_indices = None  # sized at the first capture, when the pools are known
        self._graph_qo_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_decode, self._graph_verify = {}, {}

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        """Create the wrapper of this mode and batch size over the static buffers and plan it.

        Runs outside ``torch.cuda.graph``: planning copies to and from the host.
        """
        bs = forward_batch.batch_size
        if self._graph_kv_indptr is None or self._graph_kv_last_page_len is None or bs > self._graph_max_bs:
            raise RuntimeError(f"capture of batch size {bs} before init_cuda_graph_state({bs}) or larger")
        if self._graph_kv_indices is None:
            # A row never holds more than max_context_len slots. Not the pool size: samples of one prompt
            # (n > 1) share its slots, so a batch's slot lists can add up to more than the pool.
            max_context_len = forward_batch.req_to_token_pool.req_to_token.shape[1]
            self._graph_kv_indices = torch.zeros(
                self._graph_max_bs * max_context_len, dtype=torch.int32, device=self.device
            )
        if forward_batch.forward_mode.is_target_verify():
            self._extend = self._graph_verify.get(bs) or self._new_verify_wrapper(bs)
            self._graph_verify[bs] = self._extend
            self._plan_extend(self._extend, forward_batch)
            return
        wrapper = self._graph_decode.get(bs)
        if wrapper is None:
            # Fixed-size views of the shared buffers: the graph reads them at fixed addresses, and plan() copies
            # each round's page table into them. Sharing is safe: every replay is preceded by its own plan.
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                _KV_LAYOUT,
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=self._graph_kv_indptr[: bs + 1],
                paged_kv_indices_buffer=self._graph_kv_indices,
                paged_kv_last_page_len_buffer=self._graph_kv_last_page_len[:bs],
                backend=_KERNELS,
            )
            self._graph_decode[bs] = wrapper
        self._plan_decode(wrapper, forward_batch)
        self._decode = wrapper

    def _new_verify_wrapper(self, bs: int) -> Any:
        """A prefill wrapper for TARGET_VERIFY graphs of ``bs`` requests, over views of the static buffers."""
        assert self._graph_qo_indptr is not None and self._graph_kv_indptr is not None
        assert self._graph_kv_last_page_len is not None
        return self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace,
            _KV_LAYOUT,
            use_cuda_graph=True,
            qo_indptr_buf=self._graph_qo_indptr[: bs + 1],
            paged_kv_indptr_buf=self._graph_kv_indptr[: bs + 1],
            paged_kv_indices_buf=self._graph_kv_indices,
            paged_kv_last_page_len_buf=self._graph_kv_last_page_len[:bs],
            backend=_KERNELS,
        )

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        """Re-plan the captured wrapper of this round's mode and ``batch_size`` for its lengths."""
        fb = forward_batch
        verify = fb.forward_mode.is_target_verify()
        wrapper = (self._graph_verify if verify else self._graph_decode).get(fb.batch_size)
        if wrapper is None:
            raise RuntimeError(f"no captured {fb.forward_mode.name.lower()} graph for batch size {fb.batch_size}")
        if verify:
            self._plan_extend(wrapper, fb)
            self._extend = wrapper
        else:
            self._plan_decode(wrapper, fb)
            self._decode = wrapper

    # ---- per layer ----

    def forward_decode(self, q: torch.Tensor, layer_id: int, forward_batch: ForwardBatch) -> torch.Tensor:
        return self._run(self._decode, q, layer_id, forward_batch.token_to_kv_pool)

    def forward_extend(self, q: torch.Tensor, layer_id: int, forward_batch: ForwardBatch) -> torch.Tensor:
        return self._run(self._extend, q, layer_id, forward_batch.token_to_kv_pool)

    def _run(self, wrapper: Any, q: torch.Tensor, layer_id: int, pool: TokenToKVPool) -> torch.Tensor:
        # The kernels take q's row and head strides but need dense head vectors; they write the output densely
        # ([T, heads, head_dim] contiguous), so it is allocated here rather than left to empty_like(q).
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return wrapper.run(q, self._layer_kv(pool, layer_id), out=out)

    def _layer_kv(self, pool: TokenToKVPool, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (k, v) views of one layer, built once per pool."""
        key = (pool.k_buffer.data_ptr(), pool.v_buffer.data_ptr(), tuple(pool.k_buffer.shape))
        if key != self._kv_views_of:
            self._kv_views = paged_kv_views(pool.k_buffer, pool.v_buffer)
            self._kv_views_of = key
        return self._kv_views[layer_id]
