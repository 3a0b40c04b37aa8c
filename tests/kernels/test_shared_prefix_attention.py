"""Shared-prefix attention: the groups it finds (hand-computed) and its output against a float64 softmax over each
request's whole sequence, in DECODE, EXTEND and MIXED rounds, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.attention.shared_prefix import MIN_SHARED_TOKENS, plan_shared_prefixes
from batchgen.kernels.attention.torch_native import TorchNativeAttnBackend
from batchgen.kernels.cpu import paged_attention_available
from batchgen.loop.forward_batch import ForwardBatch
from batchgen.loop.forward_mode import ForwardMode
from batchgen.loop.kv_pool import ReqToTokenPool, TokenToKVPool
from tests.helpers.paged_pool import relative_error

# Request rows 1-5: all share a 70-slot prefix (a system prompt); rows 1 and 2 share 150 slots (a task's few-shot
# examples); rows 3 and 4 share 100; row 5 shares only the 70; row 6 shares nothing.
SHARED = {1: 150, 2: 150, 3: 100, 4: 100, 5: 70}
SEQ = {1: 170, 2: 160, 3: 130, 4: 120, 5: 90, 6: 80}
HEADS, KV_HEADS, DIM = 6, 2, 64


def _table() -> ReqToTokenPool:
    pool = ReqToTokenPool(6, 256, torch.device("cpu"))
    free = iter((torch.randperm(1000, generator=torch.Generator().manual_seed(0)) + 1).tolist())
    system = [next(free) for _ in range(70)]
    few_shot = {1: system + [next(free) for _ in range(80)], 3: system + [next(free) for _ in range(30)]}
    few_shot[2], few_shot[4], few_shot[5] = few_shot[1], few_shot[3], system
    for row, length in SEQ.items():
        start = few_shot.get(row, [])
        pool.req_to_token[row, :length] = torch.tensor(start + [next(free) for _ in range(length - len(start))])
    return pool


def test_groups_follow_the_shared_slots() -> None:
    pool = _table()
    rows = [1, 2, 3, 4, 5, 6]
    plan = plan_shared_prefixes(pool.req_to_token, rows, [SEQ[r] for r in rows], [1] * 6)
    assert plan is not None and MIN_SHARED_TOKENS <= 70
    found = sorted(
        (sorted(rows[i] for i in range(6) if i in plan.grouped and _in(plan, g, i)), g.slots.numel())
        for g in plan.groups
    )
    # Rows 1+2 and 3+4 go deeper than the system prompt; row 5 is left alone with it, so it attends alone.
    assert found == [([1, 2], 150), ([3, 4], 100)]
    assert plan.grouped == {0, 1, 2, 3}
    # Queries that do not see a whole shared prefix (a prompt's first chunk) share none of it.
    assert plan_shared_prefixes(pool.req_to_token, [1, 2], [170, 160], [170, 160]) is None


def _in(plan, group, i: int) -> bool:  # type: ignore[no-untyped-def]
    """Whether request ``i`` (one query each) is in ``group``."""
    return bool((group.token_index == i).any())


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Float64 causal attention of queries at ``positions`` over keys ``[Hkv, L, D]``."""
    group = HEADS // KV_HEADS
    k, v = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    scores = torch.einsum("thd,hld->thl", q.double(), k) * DIM**-0.5
    scores = scores.masked_fill(torch.arange(k.shape[1])[None, None, :] > positions[:, None, None], float("-inf"))
    return torch.einsum("thl,hld->thd", torch.softmax(scores, -1), v)


@pytest.mark.skipif(not paged_attention_available(), reason="batchgen's C++ attention kernel did not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "mode, q_lens",
    [
        (ForwardMode.DECODE, {r: 1 for r in SEQ}),
        (ForwardMode.EXTEND, {1: 20, 2: 10, 3: 30, 4: 20, 5: 20, 6: 80}),
        (ForwardMode.MIXED, {1: 20, 2: 1, 3: 1, 4: 20, 5: 1, 6: 1}),
    ],
    ids=["decode", "extend", "mixed"],
)
def test_shared_prefix_attention_equals_full_softmax(
    mode: ForwardMode, q_lens: dict[int, int], dtype: torch.dtype
) -> None:
    req_to_token = _table()
    kv = TokenToKVPool(1000, 1, KV_HEADS, DIM, dtype, torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    kv.k_buffer[0, :, 1:] = torch.randn(KV_HEADS, 1000, DIM, generator=generator).to(dtype)
    kv.v_buffer[0, :, 1:] = torch.randn(KV_HEADS, 1000, DIM, generator=generator).to(dtype)
    rows = list(SEQ)
    total = sum(q_lens.values())
    q = torch.randn(total, HEADS, DIM, generator=generator).to(dtype)
    lens = torch.tensor([SEQ[r] for r in rows])
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=len(rows),
        input_ids=torch.zeros(total, dtype=torch.int64),
        positions=torch.cat([torch.arange(SEQ[r] - q_lens[r], SEQ[r]) for r in rows]),
        out_cache_loc=torch.zeros(total, dtype=torch.int64),
        req_pool_indices=torch.tensor(rows),
        req_pool_indices_cpu=rows,
        seq_lens=lens,
        max_seq_len=int(lens.max()),
        sample_indices=torch.zeros(0, dtype=torch.int64),
        prompt_logprob_indices=torch.zeros(0, dtype=torch.int64),
        prompt_logprob_targets=torch.zeros(0, dtype=torch.int64),
        prompt_top_k=0,
        extend_seq_lens_cpu=None if mode.is_decode() else [q_lens[r] for r in rows],
        extend_prefix_lens_cpu=None if mode.is_decode() else [SEQ[r] - q_lens[r] for r in rows],
        req_to_token_pool=req_to_token,
        token_to_kv_pool=kv,
        attn_backend=None,  # type: ignore[arg-type]
    )
    outs = {}
    for shared in (True, False):
        backend = TorchNativeAttnBackend(cpu_kernel=True, shared_prefix=shared)
        backend.init_forward_metadata(fb)
        assert (backend.metadata.shared is not None) == shared
        forward = backend.forward_decode if mode.is_decode() else backend.forward_extend
        outs[shared] = forward(q, 0, fb)
    start = 0
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for r in rows:
        slots = req_to_token.req_to_token[r, : SEQ[r]]
        ref = _reference(
            q[start : start + q_lens[r]],
            kv.k_buffer[0][:, slots],
            kv.v_buffer[0][:, slots],
            torch.arange(SEQ[r] - q_lens[r], SEQ[r]),
        )
        for shared, out in outs.items():
            assert relative_error(out[start : start + q_lens[r]], ref) <= tolerance, (r, shared)
        start += q_lens[r]
