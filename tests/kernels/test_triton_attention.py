"""batchgen's Triton attention kernels and backend, run by Triton's interpreter on the CPU.

The kernels are checked against a float64 reference on random inputs: ragged lengths from 1 to 300, GQA
ratios 1/2/4/8, head dims 64 and 128 (and 8, 96 for the padded head-dim tile), K/V slots scattered in the
pool in random order, every slot the kernels must not read filled with NaN. The engine test compares
greedy generation with the ``triton`` backend against ``torch_native``, chunked prefill included.

bfloat16 on the CPU: Triton's interpreter stores bfloat16 as raw uint16 bits (numpy has no bfloat16) and
its ``tl.dot`` multiplies those bits as integers, so the kernels upcast bfloat16 operands to float32 there
(see :func:`batchgen.kernels.triton.dot_settings`). The bfloat16 cases thus check loads, masking and the
output rounding; the half-precision dot path a GPU takes (``p`` rounded to the input dtype) is checked by
the float16 cases, which the interpreter runs natively.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.helpers.triton import use_triton_interpreter

use_triton_interpreter()

from batchgen.environment import kernel_switches  # noqa: E402
from batchgen.errors import BatchgenError  # noqa: E402
from batchgen.kernels.attention import create_attention_backend  # noqa: E402
from batchgen.kernels.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from batchgen.kernels.attention.triton_backend import TritonAttnBackend  # noqa: E402
from batchgen.kernels.triton.decode_attention import decode_attention_fwd, decode_scratch  # noqa: E402
from batchgen.kernels.triton.extend_attention import extend_attention_fwd  # noqa: E402
from batchgen.loop.forward_mode import ForwardMode  # noqa: E402
from tests.helpers.batch_invariance import assert_query_bits_independent_of_round  # noqa: E402
from tests.helpers.cli import generate, write_jsonl  # noqa: E402
from tests.helpers.paged_pool import PagedPool, decode_batch, reference_attention, relative_error  # noqa: E402

NUM_KV_HEADS = 2
POOL_SLOTS = 1500
CONTEXT = 320
DECODE_SEQ_LENS = [1, 2, 17, 64, 65, 300]
# (cached prefix, new tokens): prefix 0 with one token, one token after a prefix (a MIXED round's decode
# row), blocks crossing the 64-token tile edges, and a 300-token sequence.
EXTEND_CASES = [(0, 1), (0, 37), (5, 1), (1, 129), (100, 64), (250, 50)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}

# fp32 covers every GQA ratio at both head dims; the half types each ratio extreme; 8 and 96 the padded tile.
SHAPES = [
    *[(torch.float32, d, g) for d in (64, 128) for g in (1, 2, 4, 8)],
    *[(dt, d, g) for dt in (torch.bfloat16, torch.float16) for d in (64, 128) for g in (1, 8)],
    (torch.float32, 8, 2),
    (torch.float32, 96, 4),
]


def _shape_id(shape: tuple[torch.dtype, int, int]) -> str:
    dtype, head_dim, group = shape
    return f"{str(dtype).removeprefix('torch.')}-d{head_dim}-g{group}"


def _Pool(seq_lens: list[int], dtype: torch.dtype, head_dim: int, gen: torch.Generator) -> PagedPool:
    return PagedPool(seq_lens, dtype, NUM_KV_HEADS, head_dim, gen, POOL_SLOTS, CONTEXT)


def _reference(q: torch.Tensor, pool: PagedPool, slots: torch.Tensor, first_pos: int) -> torch.Tensor:
    return reference_attention(q, pool.k[:, slots], pool.v[:, slots], first_pos)


def _run_decode(
    dtype: torch.dtype, head_dim: int, group: int, num_kv_splits: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(output, reference) per request of one decode launch over DECODE_SEQ_LENS."""
    gen = torch.Generator().manual_seed(seed)
    pool = _Pool(DECODE_SEQ_LENS, dtype, head_dim, gen)
    batch, num_heads = len(DECODE_SEQ_LENS), NUM_KV_HEADS * group
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    mid_o, mid_lse = decode_scratch(batch, num_heads, head_dim, num_kv_splits, q.device)
    mid_o.fill_(float("nan"))  # slices stage 1 leaves empty must not be read
    mid_lse.fill_(float("nan"))
    seq_lens = torch.tensor(DECODE_SEQ_LENS)
    decode_attention_fwd(
        q, pool.k, pool.v, out, pool.req_to_token, pool.req_pool_indices, seq_lens, mid_o, mid_lse, num_kv_splits
    )
    return [(out[i : i + 1], _reference(q[i : i + 1], pool, pool.slots[i], n - 1)) for i, n in enumerate(seq_lens)]


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_decode_kernel_matches_float64(shape: tuple[torch.dtype, int, int]) -> None:
    dtype, head_dim, group = shape
    for i, (out, ref) in enumerate(_run_decode(dtype, head_dim, group, num_kv_splits=8, seed=head_dim + group)):
        assert relative_error(out, ref) <= TOLERANCE[dtype], f"request of length {DECODE_SEQ_LENS[i]}"


@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_decode_kernel_any_split_count(num_kv_splits: int) -> None:
    # 1: no split at all; 3: not a power of two, and slices that end mid-block.
    for out, ref in _run_decode(torch.float32, 64, 4, num_kv_splits, seed=num_kv_splits):
        assert relative_error(out, ref) <= 1e-5


def test_decode_kernel_row_of_length_zero_gives_zeros() -> None:
    gen = torch.Generator().manual_seed(3)
    pool = _Pool([5, 9], torch.float32, 16, gen)
    q = torch.randn(2, 4, 16, generator=gen)
    out = torch.full_like(q, float("nan"))
    mid_o, mid_lse = decode_scratch(2, 4, 16, 4, q.device)
    mid_o.fill_(float("nan"))
    mid_lse.fill_(float("nan"))
    seq_lens = torch.tensor([0, 9])
    decode_attention_fwd(q, pool.k, pool.v, out, pool.req_to_token, pool.req_pool_indices, seq_lens, mid_o, mid_lse, 4)
    assert torch.equal(out[0], torch.zeros(4, 16))
    assert relative_error(out[1:], _reference(q[1:], pool, pool.slots[1], 8)) <= 1e-5


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_extend_kernel_matches_float64(shape: tuple[torch.dtype, int, int]) -> None:
    dtype, head_dim, group = shape
    gen = torch.Generator().manual_seed(100 + head_dim + group)
    pool = _Pool([p + e for p, e in EXTEND_CASES], dtype, head_dim, gen)
    prefix_lens = torch.tensor([p for p, _ in EXTEND_CASES])
    extend_lens = torch.tensor([e for _, e in EXTEND_CASES])
    qo_start = extend_lens.cumsum(0) - extend_lens
    q = torch.randn(int(extend_lens.sum()), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    extend_attention_fwd(
        q,
        pool.k,
        pool.v,
        out,
        pool.req_to_token,
        pool.req_pool_indices,
        prefix_lens,
        extend_lens,
        qo_start,
        int(extend_lens.max()),
    )
    for i, (prefix, extend) in enumerate(EXTEND_CASES):
        rows = slice(int(qo_start[i]), int(qo_start[i]) + extend)
        ref = _reference(q[rows], pool, pool.slots[i], prefix)
        assert relative_error(out[rows], ref) <= TOLERANCE[dtype], f"prefix {prefix}, extend {extend}"


@pytest.mark.parametrize(
    "shape", [(torch.float32, 64, 4), (torch.bfloat16, 64, 1), (torch.float16, 128, 8)], ids=_shape_id
)
def test_a_querys_bits_do_not_depend_on_its_round(shape: tuple[torch.dtype, int, int]) -> None:
    """--deterministic's attention: a query decoded (alone or among others) and attended as a row of prefill chunks
    of many shapes gives the same bits (see :func:`assert_query_bits_independent_of_round`)."""
    dtype, head_dim, group = shape
    assert_query_bits_independent_of_round(dtype, head_dim, group, torch.device("cpu"), TOLERANCE[dtype])


def test_backend_decode_reuses_static_scratch_across_replays() -> None:
    """After init_cuda_graph_state, every decode of up to max_bs rows uses the same scratch and reads only
    device tensors, as a replayed CUDA graph would (lengths change between 'replays', the grid does not)."""
    gen = torch.Generator().manual_seed(5)
    pool = _Pool([40, 300, 7], torch.float32, 64, gen)
    backend = TritonAttnBackend(torch.device("cpu"), num_kv_splits=4)
    assert backend.supports_cuda_graph
    backend.init_cuda_graph_state(max_bs=4)
    pointers = set()
    for seq_lens in ([40, 300, 7], [13, 1, 7], [40, 299, 2]):
        fb = decode_batch(pool, [0, 1, 2], seq_lens)
        backend.init_forward_metadata_replay_cuda_graph(fb)
        q = torch.randn(3, 8, 64, generator=gen)
        out = backend.forward_decode(q, 0, fb)
        assert backend._graph_scratch is not None
        pointers.add(backend._graph_scratch[0].data_ptr())
        for i, n in enumerate(seq_lens):
            ref = _reference(q[i : i + 1], pool, pool.slots[i][:n], n - 1)
            assert relative_error(out[i : i + 1], ref) <= 1e-5
    assert len(pointers) == 1


def test_deterministic_decode_graph_metadata_lives_in_static_buffers() -> None:
    """--deterministic DECODE rounds after init_cuda_graph_state: the lengths the extend kernel reads sit at one
    fixed address across 'replays' of changing lengths (the grid depends on the batch size only), no split scratch
    is allocated, and each round attends as the float64 reference."""
    gen = torch.Generator().manual_seed(8)
    pool = _Pool([40, 300, 7], torch.float32, 64, gen)
    backend = TritonAttnBackend(torch.device("cpu"), deterministic=True)
    backend.init_cuda_graph_state(max_bs=4)
    pointers = set()
    for seq_lens in ([40, 300, 7], [13, 1, 7], [40, 299, 2]):
        fb = decode_batch(pool, [0, 1, 2], seq_lens)
        backend.init_forward_metadata_replay_cuda_graph(fb)
        assert backend._extend is not None
        pointers.add(backend._extend.prefix_lens.data_ptr())
        q = torch.randn(3, 8, 64, generator=gen)
        out = backend.forward_decode(q, 0, fb)
        for i, n in enumerate(seq_lens):
            ref = _reference(q[i : i + 1], pool, pool.slots[i][:n], n - 1)
            assert relative_error(out[i : i + 1], ref) <= 1e-5
    assert len(pointers) == 1 and backend._graph_scratch is None


def test_backend_verify_graph_metadata_lives_in_static_buffers() -> None:
    """TARGET_VERIFY rounds of K + 1 = 3 tokens per request after init_cuda_graph_state: the lengths the extend
    kernel reads sit at one fixed address across 'replays', and each round attends as the float64 reference."""
    gen = torch.Generator().manual_seed(6)
    pool = _Pool([40, 300, 9], torch.float32, 64, gen)
    backend = TritonAttnBackend(torch.device("cpu"))
    backend.init_cuda_graph_state(max_bs=4, verify_tokens=3)
    pointers = set()
    for seq_lens in ([40, 300, 9], [3, 100, 6]):
        fb = SimpleNamespace(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=3,
            req_pool_indices=pool.req_pool_indices,
            seq_lens=torch.tensor(seq_lens),
            extend_seq_lens_cpu=[3, 3, 3],
            extend_prefix_lens_cpu=[n - 3 for n in seq_lens],
            req_to_token_pool=SimpleNamespace(req_to_token=pool.req_to_token),
            token_to_kv_pool=SimpleNamespace(k_buffer=pool.k[None], v_buffer=pool.v[None]),
        )
        backend.init_forward_metadata_replay_cuda_graph(fb)  # type: ignore[arg-type]
        assert backend._extend is not None
        pointers.add(backend._extend.prefix_lens.data_ptr())
        q = torch.randn(9, 8, 64, generator=gen)
        out = backend.forward_extend(q, 0, fb)  # type: ignore[arg-type]
        for i, n in enumerate(seq_lens):
            ref = _reference(q[3 * i : 3 * i + 3], pool, pool.slots[i][:n], n - 3)
            assert relative_error(out[3 * i : 3 * i + 3], ref) <= 1e-5
    assert len(pointers) == 1


def test_engine_greedy_matches_torch_native(
    random_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same greedy tokens and logprobs within 1e-5 as torch_native (fp32), through chunked prefill (prefix
    plus extend), prefixes from the prefix cache, MIXED rounds (decode rows in the extend kernel) and DECODE
    rounds."""
    from batchgen.loop.kv_cache import KVCache

    rounds: list[tuple[ForwardMode, list[int], list[int]]] = []
    hits: list[int] = []
    plan, match = TritonAttnBackend.init_forward_metadata, KVCache.match

    def spy_match(self: KVCache, row: int, tokens: Any) -> int:
        hits.append(match(self, row, tokens))
        return hits[-1]

    monkeypatch.setattr(KVCache, "match", spy_match)

    def spy(self: TritonAttnBackend, forward_batch: Any) -> None:
        fb = forward_batch
        rounds.append((fb.forward_mode, fb.extend_prefix_lens_cpu or [], fb.extend_seq_lens_cpu or []))
        plan(self, forward_batch)

    monkeypatch.setattr(TritonAttnBackend, "init_forward_metadata", spy)
    rows = [
        {"id": f"r{n}", "prompt_token_ids": [0] + [(7 * n + 3 * j) % 290 + 2 for j in range(n - 1)]}
        for n in (1, 5, 19, 30)
    ]
    # Two more that start with r30's prompt: they wait for it to be cached, then prefill only their tails.
    rows += [{"id": f"s{k}", "prompt_token_ids": rows[-1]["prompt_token_ids"] + [5 + k, 9]} for k in range(2)]
    for row in rows:
        row.update(max_new_tokens=6, temperature=0, ignore_eos=True)
    dataset = write_jsonl(tmp_path / "p.jsonl", rows)
    model = random_models["llama"]
    args = ("--chunked-prefill-size", "8", "--max-running-requests", "4")
    native = generate(dataset, tmp_path / "native.arrow", model, "--attention-backend", "torch_native", *args)
    with_triton = generate(dataset, tmp_path / "triton.arrow", model, "--attention-backend", "triton", *args)
    for row in rows:
        want, got = native[row["id"]], with_triton[row["id"]]
        assert got["output_token_ids"] == want["output_token_ids"], row["id"]
        assert len(got["output_token_ids"]) == 6
        for a, b in zip(got["output_logprobs"], want["output_logprobs"]):
            assert abs(a - b) <= 1e-5, row["id"]
    modes = {mode for mode, _, _ in rounds}
    assert {ForwardMode.DECODE, ForwardMode.MIXED} <= modes, modes
    # A prefill chunk after an earlier one: several new tokens after a cached prefix.
    assert any(p > 0 and e > 1 for _, prefixes, extends in rounds for p, e in zip(prefixes, extends))
    assert max(hits) >= 30  # the s rows' prefix came from the cache (in both runs)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(BatchgenError, match="TRITON_INTERPRET=1") as err:
        create_attention_backend("triton", torch.device("cpu"), switches=kernel_switches())
    assert "\n" not in str(err.value)


def test_triton_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    with pytest.raises(BatchgenError, match="needs the triton package") as err:
        create_attention_backend("triton", torch.device("cuda"), switches=kernel_switches())
    assert "\n" not in str(err.value)
    assert isinstance(
        create_attention_backend("auto", torch.device("cuda"), switches=kernel_switches()), TorchNativeAttnBackend
    )


def test_auto_choice() -> None:
    assert isinstance(
        create_attention_backend("auto", torch.device("cpu"), switches=kernel_switches()), TorchNativeAttnBackend
    )
    # Building the backend touches no GPU, so the CUDA choice can be checked here.
    assert isinstance(
        create_attention_backend("auto", torch.device("cuda"), switches=kernel_switches()), TritonAttnBackend
    )
    assert isinstance(
        create_attention_backend("triton", torch.device("cpu"), switches=kernel_switches()), TritonAttnBackend
    )


@pytest.mark.parametrize(
    ("src_dtype", "pool_dtype", "head_dim"),
    # The model's K/V already have the pool's dtype; float32 → float16 checks the conversion path (bfloat16 is
    # raw bits in the interpreter, so its conversion is not what a GPU does).
    [
        (torch.float32, torch.float32, 64),
        (torch.bfloat16, torch.bfloat16, 128),
        (torch.float16, torch.float16, 24),
        (torch.float32, torch.float16, 32),
    ],
)
def test_kv_store_writes_exactly_the_given_slots(
    src_dtype: torch.dtype, pool_dtype: torch.dtype, head_dim: int
) -> None:
    """Against index_copy_ on the transposed inputs (the torch store): the given slots get the new K/V in the
    pool's dtype, every other slot keeps its bits; K/V may be strided views (slices of the fused qkv output)."""
    from batchgen.kernels.triton.kv_store import store_kv

    gen = torch.Generator().manual_seed(3)
    num_kv_heads, slots, tokens = 2, 64, 9
    qkv = torch.randn(tokens, 3 * num_kv_heads * head_dim, generator=gen).to(src_dtype)
    k = qkv[:, : num_kv_heads * head_dim].view(tokens, num_kv_heads, head_dim)
    v = qkv[:, 2 * num_kv_heads * head_dim :].view(tokens, num_kv_heads, head_dim)
    loc = torch.randperm(slots - 1, generator=gen)[:tokens] + 1
    k_buf = torch.randn(num_kv_heads, slots, head_dim, generator=gen).to(pool_dtype)
    v_buf = torch.randn(num_kv_heads, slots, head_dim, generator=gen).to(pool_dtype)
    k_want = k_buf.clone().index_copy_(1, loc, k.transpose(0, 1).to(pool_dtype))
    v_want = v_buf.clone().index_copy_(1, loc, v.transpose(0, 1).to(pool_dtype))
    store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf, k_want) and torch.equal(v_buf, v_want)
