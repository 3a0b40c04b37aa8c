"""Batch-invariance checks of the Triton kernels ``--deterministic`` runs on the GPU path, shared by their tests in
Triton's interpreter (tests/kernels) and on CUDA (tests/gpu): one input computed in many batch shapes must give the
same bits in each, and agree with a float64 reference. The kernels are imported when a check runs, so that an
interpreter test module can set ``TRITON_INTERPRET`` first."""

from __future__ import annotations

import torch

from tests.helpers.paged_pool import PagedPool, decode_batch, reference_attention, relative_error

# The query's sequence: three key blocks of 64, a query position in each.
INVARIANCE_SEQ = 150
QUERY_POSITIONS = (5, 70, 130)


def chunks_holding(pos: int) -> list[tuple[int, int]]:
    """(cached prefix, new tokens) of chunks holding position ``pos``: the whole prompt up to it, the token alone,
    the query mid-chunk (keys past it in its tile), a verify round's 4, a 64-aligned tile, the whole sequence."""
    spans = [(0, pos + 1), (pos, 1), (max(0, pos - 10), 16), (max(0, pos - 2), 4), (pos - pos % 64, 64)]
    return [(p, min(e, INVARIANCE_SEQ - p)) for p, e in spans] + [(0, INVARIANCE_SEQ)]


def assert_query_bits_independent_of_round(
    dtype: torch.dtype, head_dim: int, group: int, device: torch.device, tolerance: float
) -> None:
    """One query at each of :data:`QUERY_POSITIONS`, decoded by the Triton backend's ``--deterministic`` mode alone
    (eager) and as the middle of three requests (through the static buffers CUDA graphs replay), and attended as a
    row of every chunk of :func:`chunks_holding` after another request's 20 rows (``extend_attention_fwd``): the same
    bits every time, within ``tolerance`` (relative) of the float64 reference. Two KV heads of ``head_dim``,
    ``group`` query heads each; K/V scattered over a pool whose unowned slots hold NaN."""
    from batchgen.kernels.attention.triton_backend import TritonAttnBackend
    from batchgen.kernels.triton.extend_attention import extend_attention_fwd

    gen = torch.Generator().manual_seed(11 + head_dim + group)
    paged = PagedPool([INVARIANCE_SEQ, 90, 7], dtype, 2, head_dim, gen, num_slots=1500, context=320)
    pool = paged.to(device)
    eager = TritonAttnBackend(device, deterministic=True)
    graphed = TritonAttnBackend(device, deterministic=True)
    graphed.init_cuda_graph_state(max_bs=4)
    num_heads = 2 * group

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    for pos in QUERY_POSITIONS:
        q_pos = randn(num_heads, head_dim)
        q = randn(3, num_heads, head_dim)
        q[1] = q_pos
        among_three = decode_batch(pool, [1, 0, 2], [40, pos + 1, 7])
        graphed.init_forward_metadata_replay_cuda_graph(among_three)
        results = {"decode among three": graphed.forward_decode(q, 0, among_three)[1]}
        alone = decode_batch(pool, [0], [pos + 1])
        eager.init_forward_metadata(alone)
        results["decode alone"] = eager.forward_decode(q[1:2], 0, alone)[0]
        for prefix, extend in chunks_holding(pos):
            # Request 1 extends 20 tokens after 10 first, so ours starts at row 20 of q.
            q = randn(20 + extend, num_heads, head_dim)
            q[20 + pos - prefix] = q_pos
            out = torch.full_like(q, float("nan"))
            lens = [torch.tensor(values, device=device) for values in ([10, prefix], [20, extend], [0, 20])]
            index = pool.req_pool_indices[[1, 0]]
            extend_attention_fwd(q, pool.k, pool.v, out, pool.req_to_token, index, *lens, max(20, extend))
            results[f"chunk of {extend} after {prefix}"] = out[20 + pos - prefix]
        slots = paged.slots[0][: pos + 1]
        ref = reference_attention(q_pos[None].cpu(), paged.k[:, slots], paged.v[:, slots], pos)
        assert relative_error(results["decode alone"][None].cpu(), ref) <= tolerance, pos
        for name, got in results.items():
            assert torch.equal(got, results["decode alone"]), f"position {pos}: {name}"


def matmul_operands(
    n: int, k: int, dtype: torch.dtype, device: torch.device, seed: int, rows: int = 64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x ``[rows, k]``, W ``[n, k]`` scaled so that outputs are about unit size, bias ``[n]``; in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen)
    return x.to(dtype).to(device), w.to(dtype).to(device), b.to(dtype).to(device)


def assert_matmul_rows_independent_of_batch(
    n: int, k: int, dtype: torch.dtype, device: torch.device, batch_sizes: tuple[int, ...]
) -> None:
    """Rows 0-2 computed alone, among the first ``m`` rows for each ``m`` of ``batch_sizes``, as rows 65-67 (a
    second row tile), and after the batch's rows are shuffled: the same bits every time as alone."""
    from batchgen.kernels.triton.matmul import matmul

    x, w, b = matmul_operands(n, k, dtype, device, seed=7, rows=max(batch_sizes))
    alone = torch.cat([matmul(x[r : r + 1], w, b) for r in range(3)])
    for m in batch_sizes:
        rows = min(m, 3)
        assert torch.equal(matmul(x[:m], w, b)[:rows], alone[:rows]), f"M = {m}"
    others = torch.randn(65, k, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    wide = torch.cat([others, x[:3]])
    assert torch.equal(matmul(wide, w, b)[65:], alone), "rows 65-67 of 68"
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(2)).to(device)
    shuffled = matmul(x[order], w, b)
    for r in range(3):
        assert torch.equal(shuffled[(order == r).nonzero().item()], alone[r]), f"row {r} shuffled"


def assert_matmul_matches_float64(n: int, k: int, dtype: torch.dtype, device: torch.device, tolerance: float) -> None:
    """17 rows of ``x @ W^T (+ b)`` within ``tolerance`` of float64, relative to the largest output; with and
    without bias."""
    from batchgen.kernels.triton.matmul import matmul

    x, w, b = matmul_operands(n, k, dtype, device, seed=n + k, rows=17)
    for bias in (None, b):
        ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
        out = matmul(x, w, bias)
        assert out.dtype == dtype and out.shape == (17, n)
        error = float((out.double() - ref).abs().max() / ref.abs().max())
        assert error <= tolerance, f"bias {bias is not None}: {error}"
