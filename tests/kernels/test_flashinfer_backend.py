"""The FlashInfer backend without a GPU: it imports without flashinfer, refuses CPU / float32 / odd head sizes with
one-line errors, builds FlashInfer's page tables correctly, and, run against a pure-torch stand-in for FlashInfer's
wrappers (same call signatures as flashinfer 0.5.3, its documented paged-KV and causal semantics), attends exactly
like the torch_native backend in EXTEND, MIXED, DECODE and TARGET_VERIFY rounds and through the CUDA-graph hooks.

"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from batchgen.errors import BatchgenError
from batchgen.kernels.attention import flashinfer_backend as fib
from batchgen.kernels.attention import flashinfer_paging as paging
from batchgen.kernels.attention import flashinfer_support as fis
from batchgen.kernels.attention.flashinfer_backend import FlashInferAttnBackend
from batchgen.kernels.attention.torch_native import TorchNativeAttnBackend
from batchgen.loop.forward_mode import ForwardMode
from tests.helpers.paged_scene import ROUNDS, PagedScene, compare_backends

# ---- a CPU stand-in for flashinfer's two wrappers ----


def _attend(
    q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], qo_indptr: list[int], kv: dict[str, Any], causal: bool
) -> torch.Tensor:
    """FlashInfer's semantics: NHD pages of one slot; causal mask aligned to the end of each request's KV."""
    k_cache, v_cache = kv_cache
    assert k_cache.dim() == 4 and k_cache.shape[1] == 1 and k_cache.stride(-1) == 1
    indptr = kv["indptr"].tolist()
    out = torch.empty_like(q)
    for i in range(len(indptr) - 1):
        rows = slice(qo_indptr[i], qo_indptr[i + 1])
        slots = kv["indices"][indptr[i] : indptr[i + 1]].long()
        group = q.shape[1] // k_cache.shape[2]
        k = k_cache[slots, 0].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_cache[slots, 0].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q[rows].float(), k) * kv["sm_scale"]
        n, length = scores.shape[1], scores.shape[2]
        if causal:
            allowed = torch.arange(length)[None, :] <= torch.arange(n)[:, None] + (length - n)
            scores = scores.masked_fill(~allowed, float("-inf"))
        out[rows] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v).to(q.dtype)
    return out


class _FakeWrapperBase:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", **kwargs: Any) -> None:
        assert kv_layout == "NHD" and kwargs.get("backend") == "fa2"
        assert float_workspace_buffer.dtype == torch.uint8 and not float_workspace_buffer.any()
        self.kwargs = kwargs
        self.use_cuda_graph = kwargs.get("use_cuda_graph", False)
        self.plans = 0

    def _store(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, **plan: Any) -> None:
        for t in (indptr, indices, last_page_len):
            assert t.dtype == torch.int32
        # Host indptr/last_page_len: plan() reads them on the host, a device copy would cost a sync.
        assert indptr.device.type == "cpu" and last_page_len.device.type == "cpu"
        assert bool((last_page_len == 1).all()) and plan["page_size"] == 1 and plan["pos_encoding_mode"] == "NONE"
        self.plans += 1
        self.kv: dict[str, Any] = {"indptr": indptr, "indices": indices, "sm_scale": plan["sm_scale"]}
        if self.use_cuda_graph:
            # As FlashInfer: copy into the fixed buffers, which the (captured) kernels then read. The decode
            # wrapper names them *_buffer, the prefill wrapper *_buf.
            suffix = "_buffer" if "paged_kv_indptr_buffer" in self.kwargs else "_buf"
            indptr_buf = self.kwargs["paged_kv_indptr" + suffix]
            indices_buf = self.kwargs["paged_kv_indices" + suffix]
            if len(indptr_buf) != len(indptr) or len(indices) > len(indices_buf):
                raise ValueError("batch size or page count does not fit the CUDA-graph buffers")
            indptr_buf.copy_(indptr)
            indices_buf[: len(indices)].copy_(indices)
            self.kwargs["paged_kv_last_page_len" + suffix].copy_(last_page_len)
            self.kv = {"indptr": indptr_buf, "indices": indices_buf, "sm_scale": plan["sm_scale"]}


class FakeDecodeWrapper(_FakeWrapperBase):
    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str = "NONE",
        q_data_type: Any = "float16",
        kv_data_type: Any = None,
        sm_scale: float | None = None,
    ) -> None:
        self._store(
            indptr, indices, last_page_len, page_size=page_size, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale
        )

    def run(self, q: torch.Tensor, paged_kv_cache: Any, *, out: torch.Tensor | None = None) -> torch.Tensor:
        result = _attend(q, paged_kv_cache, list(range(q.shape[0] + 1)), self.kv, causal=False)
        assert out is not None and out.is_contiguous()
        return out.copy_(result)


class FakePrefillWrapper(_FakeWrapperBase):
    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        sm_scale: float | None = None,
        q_data_type: Any = "float16",
        kv_data_type: Any = None,
    ) -> None:
        self._store(
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            page_size=page_size,
            pos_encoding_mode=pos_encoding_mode,
            sm_scale=sm_scale,
        )
        self.qo_indptr, self.causal = qo_indptr.tolist(), causal
        if self.use_cuda_graph:
            qo_buf = self.kwargs["qo_indptr_buf"]
            if len(qo_buf) != len(qo_indptr):
                raise ValueError("batch size does not fit the CUDA-graph buffers")
            qo_buf.copy_(qo_indptr)

    def run(self, q: torch.Tensor, paged_kv_cache: Any, *, out: torch.Tensor | None = None) -> torch.Tensor:
        assert out is not None and out.is_contiguous()
        return out.copy_(_attend(q, paged_kv_cache, self.qo_indptr, self.kv, self.causal))


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``import flashinfer`` gives the CPU stand-in, and the backend accepts the CPU and float32."""
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper  # type: ignore[attr-defined]
    module.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(fib, "unavailable_reason", lambda *args: None)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(multi_processor_count=8, major=9)
    )
    yield


# ---- tests ----


def test_module_imports_without_flashinfer() -> None:
    code = (
        "import sys; sys.modules['flashinfer'] = None\n"  # any `import flashinfer` now raises ImportError
        "import batchgen.kernels.attention.flashinfer_backend as m\n"
        "assert m.FlashInferAttnBackend.supports_cuda_graph\n"
        "print('imported')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and "imported" in result.stdout, result.stderr


def test_page_table_of_a_small_batch() -> None:
    req_to_token = torch.zeros(4, 8, dtype=torch.int64)
    req_to_token[1, :4] = torch.tensor([11, 12, 13, 14])
    req_to_token[2, :3] = torch.tensor([7, 3, 9])
    req_to_token[3, :1] = torch.tensor([5])
    index = paging.build_paged_kv_index(req_to_token, torch.tensor([2, 1, 3]), torch.tensor([3, 2, 1]), [3, 2, 1])
    assert index.kv_indptr.tolist() == [0, 3, 5, 6]
    assert index.kv_indices.tolist() == [7, 3, 9, 11, 12, 5]
    assert index.kv_last_page_len.tolist() == [1, 1, 1]
    for t in (index.kv_indptr, index.kv_indices, index.kv_last_page_len):
        assert t.dtype == torch.int32
    assert paging.indptr_from_lengths([4, 1, 3]).tolist() == [0, 4, 5, 8]  # qo_indptr from the extend lengths
    assert paging.indptr_from_lengths([]).tolist() == [0]


def test_paged_kv_views_read_the_head_major_pool_in_place() -> None:
    layers, heads, slots, head_dim = 2, 3, 7, 4
    k = torch.arange(layers * heads * slots * head_dim, dtype=torch.float32).view(layers, heads, slots, head_dim)
    views = paging.paged_kv_views(k, -k)
    assert len(views) == layers
    view = views[1][0]
    assert view.shape == (slots, 1, heads, head_dim)
    assert view.data_ptr() == k[1].data_ptr()
    assert (view.stride(0), view.stride(2), view.stride(3)) == (head_dim, slots * head_dim, 1)
    assert torch.equal(view[5, 0, 2], k[1, 2, 5]) and torch.equal(views[1][1][5, 0, 2], -k[1, 2, 5])
    # paged_kv_t's uint32 strides: a page stride of slots * head_dim = 2**32 cannot be expressed.
    huge = torch.empty((1, 1, 2**25, 128), device="meta")
    with pytest.raises(BatchgenError, match="too large for its 32-bit strides"):
        paging.paged_kv_views(huge, huge)


def test_workspace_grows_with_heads_and_graph_batch() -> None:
    mib = 1 << 20
    # Llama-1B shape (32 q heads, 8 kv heads, 64 dims) on 132 SMs fits FlashInfer's usual 128 MiB, graphs or not.
    assert paging.workspace_bytes(32, 8, 64, 132) == paging.MIN_WORKSPACE_BYTES
    assert paging.workspace_bytes(32, 8, 64, 132, max_graph_bs=256) == paging.MIN_WORKSPACE_BYTES
    # 64 q heads of 128: eager split needs 64*33*128*129*4 bytes; a batch-256 graph 64*383*16*129*4 (see scheduler.cuh).
    eager = paging.workspace_bytes(64, 8, 128, 132)
    graph = paging.workspace_bytes(64, 8, 128, 132, max_graph_bs=256)
    assert eager >= 64 * 33 * 128 * 129 * 4 > paging.MIN_WORKSPACE_BYTES
    assert graph >= 64 * 383 * 16 * 129 * 4 > eager
    assert eager % mib == 0 and graph % mib == 0


def test_workspace_holds_the_verify_graphs_of_speculative_decoding() -> None:
    # On an H200 (132 SMs), capturing Llama-1B's batch-256 TARGET_VERIFY graph with 4 drafts (5 queries a request)
    # failed in FlashInfer 0.5.3's plan: "Buffer overflow when allocating memory for batch_prefill_tmp_v with size
    # 309329920". That is 32 heads * 295 tiles * cta_tile_q 128 * 64 dims * 4 bytes, and tmp_s adds
    # 32 * 295 * 128 * 4 bytes after it.
    tmp_v, tmp_s = 309_329_920, 32 * 295 * 128 * 4
    assert paging.workspace_bytes(32, 8, 64, 132, max_graph_bs=256, graph_tokens=5) >= tmp_v + tmp_s


def test_workspace_on_gpus_before_ampere() -> None:
    # Before SM80 FlashInfer's FA2 tiles are never under 64 query rows (FA2DetermineCtaTileQ, utils.cuh): on a T4
    # (40 SMs) batch-256 DECODE graphs of 32 heads (8 KV) need 32 * (ceil(256 * 4 / 64) + 255) tiles * 64 rows
    # * (head_dim + 1) * 4 bytes, over the 128 MiB that Ampere's 16-row tiles need.
    for head_dim in (64, 128):
        need = 32 * (256 * 4 // 64 + 255) * 64 * (head_dim + 1) * 4
        assert need > paging.MIN_WORKSPACE_BYTES
        assert paging.workspace_bytes(32, 8, head_dim, 40, max_graph_bs=256, ampere_or_newer=False) >= need
    assert paging.workspace_bytes(32, 8, 64, 40, max_graph_bs=256) == paging.MIN_WORKSPACE_BYTES


def test_construction_on_cpu_is_a_one_line_error() -> None:
    with pytest.raises(BatchgenError, match="needs a CUDA device, not cpu; use torch_native on CPU") as info:
        FlashInferAttnBackend(torch.device("cpu"), torch.bfloat16, 8, 2, 64)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda_is_a_one_line_error() -> None:
    with pytest.raises(BatchgenError, match="needs CUDA, which is not available on this machine"):
        FlashInferAttnBackend(torch.device("cuda"), torch.bfloat16, 8, 2, 64)


def test_unsupported_dtype_head_dim_and_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = fis.config_problem(torch.float32, 8, 2, 64)
    assert problem is not None and "float16 and bfloat16 models only, not float32" in problem
    problem = fis.config_problem(torch.bfloat16, 4, 2, 16)
    assert problem is not None and "head_dim 64, 128 or 256; this model's is 16" in problem
    assert fis.config_problem(torch.float16, 32, 8, 128) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    fis.import_problem.cache_clear()
    try:
        reason = fis.unavailable_reason(torch.device("cuda"), torch.bfloat16, 8, 2, 64)
    finally:
        fis.import_problem.cache_clear()
    assert reason is not None and reason.startswith(
        "--attention-backend flashinfer needs the flashinfer-python package"
    )
    assert "\n" not in reason


def test_matches_torch_native_in_every_round_kind(fake_flashinfer: None) -> None:
    device = torch.device("cpu")
    scene = PagedScene(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=device)
    backend = FlashInferAttnBackend(device, torch.float32, 4, 2, 8)
    compare_backends(scene, TorchNativeAttnBackend(), backend, 4, ROUNDS, atol=1e-5)
    # Once per round, not per layer; the prefill wrapper's first plan is the kernel build at construction.
    assert backend._prefill.plans == 1 + 4 and backend._eager_decode.plans == 2


def test_kernel_build_failure_is_a_one_line_error(fake_flashinfer: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_plan(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Ninja build failed. Ninja output:\nnvcc fatal : Unsupported gpu architecture")

    monkeypatch.setattr(FakePrefillWrapper, "plan", broken_plan)
    with pytest.raises(BatchgenError, match=r"could not build its kernels \(.*\): Ninja build failed\.") as info:
        FlashInferAttnBackend(torch.device("cpu"), torch.bfloat16, 8, 2, 64)
    assert "\n" not in str(info.value)


def test_cuda_graph_hooks_replan_the_captured_wrapper(fake_flashinfer: None) -> None:
    device = torch.device("cpu")
    scene = PagedScene(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=device)
    backend = FlashInferAttnBackend(device, torch.float32, 4, 2, 8)
    reference = TorchNativeAttnBackend()
    compare_backends(scene, reference, backend, 4, ROUNDS[:3], atol=1e-5)
    backend.init_cuda_graph_state(4)
    capture = scene.batch(ForwardMode.DECODE, [(1, 31, 1), (2, 4, 1), (3, 6, 1)], backend)
    backend.init_forward_metadata_capture_cuda_graph(capture)
    wrapper = backend._graph_decode[3]
    assert wrapper.use_cuda_graph and len(wrapper.kwargs["paged_kv_indptr_buffer"]) == 4
    with pytest.raises(RuntimeError, match="after graphs were captured"):
        backend.init_cuda_graph_state(8)  # could reallocate the workspace under the captured graph
    # Later rounds of three rows re-plan that wrapper (what a replay reads); other sizes run eagerly.
    for rows in ([(1, 32, 1), (2, 5, 1), (3, 7, 1)], [(1, 33, 1), (2, 6, 1), (3, 8, 1)]):
        fb = scene.batch(ForwardMode.DECODE, rows, backend)
        backend.init_forward_metadata_replay_cuda_graph(fb)
        fb_ref = dataclasses.replace(fb, attn_backend=reference)
        reference.init_forward_metadata(fb_ref)
        for layer in range(2):
            q, k, v = (torch.randn(3, h, 8) for h in (4, 2, 2))
            torch.testing.assert_close(backend.forward(q, k, v, layer, fb), reference.forward(q, k, v, layer, fb_ref))
    assert wrapper.plans == 3
    with pytest.raises(RuntimeError, match="no captured decode graph for batch size 2"):
        backend.init_forward_metadata_replay_cuda_graph(
            scene.batch(ForwardMode.DECODE, [(2, 7, 1), (3, 9, 1)], backend)
        )


def test_cuda_graph_hooks_replan_the_captured_verify_wrapper(fake_flashinfer: None) -> None:
    """TARGET_VERIFY rounds of K + 1 = 4 tokens per request: captured with a prefill wrapper over the static
    buffers, re-planned before each replay, attending as torch_native; decode graphs stay separate."""
    device = torch.device("cpu")
    scene = PagedScene(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=device)
    backend = FlashInferAttnBackend(device, torch.float32, 4, 2, 8)
    reference = TorchNativeAttnBackend()
    compare_backends(scene, reference, backend, 4, ROUNDS[:3], atol=1e-5)
    backend.init_cuda_graph_state(4, verify_tokens=4)
    backend.init_forward_metadata_capture_cuda_graph(
        scene.batch(ForwardMode.TARGET_VERIFY, [(1, 31, 4), (2, 4, 4), (3, 6, 4)], backend)
    )
    wrapper = backend._graph_verify[3]
    assert wrapper.use_cuda_graph and len(wrapper.kwargs["qo_indptr_buf"]) == 4 and not backend._graph_decode
    for rows in ([(1, 35, 4), (2, 8, 4), (3, 10, 4)], [(1, 39, 4), (2, 12, 4), (3, 14, 4)]):
        fb = scene.batch(ForwardMode.TARGET_VERIFY, rows, backend)
        backend.init_forward_metadata_replay_cuda_graph(fb)
        assert wrapper.kwargs["qo_indptr_buf"].tolist() == [0, 4, 8, 12]
        fb_ref = dataclasses.replace(fb, attn_backend=reference)
        reference.init_forward_metadata(fb_ref)
        for layer in range(2):
            q, k, v = (torch.randn(12, h, 8) for h in (4, 2, 2))
            torch.testing.assert_close(backend.forward(q, k, v, layer, fb), reference.forward(q, k, v, layer, fb_ref))
    assert wrapper.plans == 3
    with pytest.raises(RuntimeError, match="no captured decode graph for batch size 3"):
        backend.init_forward_metadata_replay_cuda_graph(
            scene.batch(ForwardMode.DECODE, [(1, 43, 1), (2, 16, 1), (3, 18, 1)], backend)
        )
