"""A paged KV pool whose requests hold shuffled (non-contiguous) slots, the rounds of every kind run over it, and
a comparison of two attention backends on them: shared by the FlashInfer tests on the CPU (against a stand-in) and
on a GPU (tests/gpu/test_cuda.py, against the real kernels)."""

from __future__ import annotations

import dataclasses

import torch

from batchgen.kernels.attention.base import AttentionBackend
from batchgen.loop.forward_batch import ForwardBatch
from batchgen.loop.forward_mode import ForwardMode
from batchgen.loop.kv_pool import ReqToTokenPool, TokenToKVPool

Round = list[tuple[int, int, int]]  # (request row, cached prefix length, new tokens) per request


class PagedScene:
    """KV pools whose requests get shuffled (non-contiguous) slots, and a ForwardBatch builder for them."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        size: int = 512,
        seed: int = 0,
        rows: int = 8,
    ) -> None:
        self.device = device
        self.req_to_token_pool = ReqToTokenPool(rows, 160, device)
        self.kv_pool = TokenToKVPool(size, num_layers, num_kv_heads, head_dim, dtype, device)
        generator = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(size, generator=generator) + 1).tolist()

    def batch(self, mode: ForwardMode, rows: Round, backend: AttentionBackend) -> ForwardBatch:
        """A round in which each request ``row`` appends ``extend`` tokens after ``prefix`` cached ones."""
        table = self.req_to_token_pool.req_to_token
        locs: list[int] = []
        for row, prefix, extend in rows:
            slots = [self.free.pop() for _ in range(extend)]
            table[row, prefix : prefix + extend] = torch.tensor(slots, device=self.device)
            locs += slots
        seq_lens = [prefix + extend for _, prefix, extend in rows]
        is_extend = not mode.is_decode()  # EXTEND, MIXED and TARGET_VERIFY rounds carry per-request lengths

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        empty = tensor([])
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(rows),
            input_ids=tensor([0] * len(locs)),
            positions=tensor([p for _, prefix, extend in rows for p in range(prefix, prefix + extend)]),
            out_cache_loc=tensor(locs),
            req_pool_indices=tensor([row for row, _, _ in rows]),
            req_pool_indices_cpu=[row for row, _, _ in rows],
            seq_lens=tensor(seq_lens),
            max_seq_len=max(seq_lens),
            sample_indices=empty,
            prompt_logprob_indices=empty,
            prompt_logprob_targets=empty,
            prompt_top_k=0,
            extend_seq_lens_cpu=[extend for _, _, extend in rows] if is_extend else None,
            extend_prefix_lens_cpu=[prefix for _, prefix, _ in rows] if is_extend else None,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.kv_pool,
            attn_backend=backend,
        )


# Rounds of three requests: whole prompts, a second chunk after a prefix, MIXED (a chunk, a decode, a new prompt),
# DECODE, then TARGET_VERIFY (speculative decoding: a pending token and three drafts per request, attended as an
# EXTEND).
ROUNDS: list[tuple[ForwardMode, Round]] = [
    (ForwardMode.EXTEND, [(1, 0, 5), (2, 0, 3)]),
    (ForwardMode.EXTEND, [(1, 5, 17)]),
    (ForwardMode.MIXED, [(3, 0, 6), (1, 22, 9), (2, 3, 1)]),
    (ForwardMode.DECODE, [(1, 31, 1), (2, 4, 1), (3, 6, 1)]),
    (ForwardMode.DECODE, [(2, 5, 1), (3, 7, 1)]),
    (ForwardMode.TARGET_VERIFY, [(1, 32, 4), (2, 6, 4), (3, 8, 4)]),
]


def compare_backends(
    scene: PagedScene,
    reference: AttentionBackend,
    backend: AttentionBackend,
    num_heads: int,
    rounds: list[tuple[ForwardMode, Round]],
    atol: float,
) -> None:
    """Run ``rounds`` through both backends layer by layer (same q, k, v; same pool) and compare outputs."""
    pool = scene.kv_pool
    num_layers, num_kv_heads, _, head_dim = pool.k_buffer.shape
    generator = torch.Generator().manual_seed(1)
    for mode, rows in rounds:
        fb = scene.batch(mode, rows, backend)
        fb_ref = dataclasses.replace(fb, attn_backend=reference)
        backend.init_forward_metadata(fb)
        reference.init_forward_metadata(fb_ref)
        num_tokens = fb.out_cache_loc.numel()
        for layer in range(num_layers):
            q, k, v = (
                torch.randn(num_tokens, heads, head_dim, generator=generator).to(pool.k_buffer.dtype).to(scene.device)
                for heads in (num_heads, num_kv_heads, num_kv_heads)
            )
            expected = reference.forward(q, k, v, layer, fb_ref)
            got = backend.forward(q, k, v, layer, fb)
            assert got.shape == q.shape
            torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0, msg=f"{mode.name} {layer}")
