"""Edge cases of the C++ paged-attention kernel's brgemm and shared-prefix paths (a review of issue 21).

brgemm: head sizes 32, 96, 160 and 192 (the other tests take 64, 128 and 256) with GQA groups 5 and 7,
sequences of exactly 256, 257, 512 and 513 keys around the 256-key blocks, a whole prompt with no cached prefix,
and rows whose queries (``q_len * group``) number 7, 8, 9 and 16 (one KV head, scores in the hundreds). Shared
prefixes:
one request row passed several times in one call at different lengths (1 to 400 keys, across 64-key blocks),
prefixes that end inside a block, and 100 decode rows of a group of 3 (300 queries) over one prefix. Every row is
checked against the float64 reference and against the bits it gives alone; ``out`` with rows covering part of q.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import cpu as cpu_kernels
from batchgen.kernels.cpu import BrgemmRows
from tests.helpers.paged_pool import (
    PagedPool,
    index,
    kernel_attention,
    reference_attention,
    relative_error,
    share_prefix,
    skip_without_brgemm,
    skip_without_cpu_kernel,
)

TOLERANCE = 2e-2  # bfloat16 inputs, probabilities rounded to bfloat16


@pytest.fixture(scope="module", autouse=True)
def _kernel_built() -> None:
    skip_without_cpu_kernel()


def _check_rows(
    pool: PagedPool,
    q: torch.Tensor,
    rows: list[int],
    seq_lens: list[int],
    q_lens: list[int],
    brgemm: BrgemmRows,
    every: int = 1,
) -> None:
    """All rows in one call: each ``every``-th matches float64 over the first ``seq_len`` keys of its sequence, and
    gives the bits it gives alone, except a row of fewer than 8 queries with ``MANY_QUERIES``: those sharing a prefix
    with others run it as GEMMs over all their queries, which round otherwise than the vector path they take alone."""
    group = q.shape[1] // pool.k.shape[0]
    together = kernel_attention(pool, q, rows, seq_lens, q_lens, brgemm=brgemm)
    start = 0
    for i, (row, n, t) in enumerate(zip(rows, seq_lens, q_lens)):
        if i % every:
            start += t
            continue
        got = together[start : start + t]
        slots = pool.slots[row][:n]
        ref = reference_attention(q[start : start + t], pool.k[:, slots], pool.v[:, slots], n - t)
        err = relative_error(got, ref)
        assert err <= TOLERANCE, f"row {i} (sequence {row}, {n} keys, {t} new): {err}"
        if not (brgemm == BrgemmRows.MANY_QUERIES and t * group < 8):
            alone = kernel_attention(pool, q[start : start + t], [row], [n], [t], brgemm=brgemm)
            assert torch.equal(got, alone), f"row {i} (sequence {row}, {n} keys, {t} new) differs from itself alone"
        start += t


@pytest.mark.parametrize("brgemm", [BrgemmRows.MANY_QUERIES, BrgemmRows.EVERY_ROW], ids=["many", "every"])
@pytest.mark.parametrize(("head_dim", "group"), [(32, 7), (96, 5), (160, 2), (192, 7)])
def test_brgemm_head_sizes_and_block_edges(head_dim: int, group: int, brgemm: BrgemmRows) -> None:
    """Rows of exactly 256, 257, 512 and 513 keys: a whole 256-token prompt, 9 and 70 new tokens after a cached
    prefix, 130 new tokens (several 64-query items), and a decode beside them."""
    skip_without_brgemm(head_dim)
    gen = torch.Generator().manual_seed(head_dim + group)
    seq_lens, q_lens = [256, 257, 512, 513, 300], [256, 9, 70, 130, 1]
    pool = PagedPool(seq_lens, torch.bfloat16, 2, head_dim, gen, 2000, 600)
    q = torch.randn(sum(q_lens), 2 * group, head_dim, generator=gen).to(torch.bfloat16)
    _check_rows(pool, q, list(range(5)), seq_lens, q_lens, brgemm)


@pytest.mark.parametrize(("group", "new"), [(7, 1), (1, 7), (8, 1), (4, 2), (1, 8), (9, 1), (3, 3)])
@pytest.mark.parametrize("brgemm", list(BrgemmRows), ids=["vector", "many", "every"])
def test_rows_of_seven_eight_and_nine_queries(group: int, new: int, brgemm: BrgemmRows) -> None:
    """``q_len * group`` of 7, 8 and 9 (brgemm takes rows of at least 8 queries), one KV head."""
    if brgemm:
        skip_without_brgemm()
    gen = torch.Generator().manual_seed(group * 10 + new)
    pool = PagedPool([300, 64], torch.bfloat16, 1, 64, gen, 800, 400)
    q = torch.randn(2 * new, group, 64, generator=gen).to(torch.bfloat16)
    _check_rows(pool, q, [0, 1], [300, 64], [new, new], brgemm)


@pytest.mark.parametrize("brgemm", list(BrgemmRows), ids=["vector", "many", "every"])
def test_one_request_row_passed_several_times(brgemm: BrgemmRows) -> None:
    """Sequence 0 as eight rows of one call, 1 to 400 keys long (every row's slots a prefix of the longest's),
    decodes and one 30-token chunk, a group of 3."""
    if brgemm:
        skip_without_brgemm()
    gen = torch.Generator().manual_seed(11)
    pool = PagedPool([400], torch.bfloat16, 2, 64, gen, 800, 500)
    seq_lens, q_lens = [400, 300, 257, 256, 65, 64, 63, 1], [1, 1, 30, 1, 1, 2, 1, 1]
    q = torch.randn(sum(q_lens), 6, 64, generator=gen).to(torch.bfloat16)
    _check_rows(pool, q, [0] * 8, seq_lens, q_lens, brgemm)


@pytest.mark.parametrize("brgemm", list(BrgemmRows), ids=["vector", "many", "every"])
def test_prefixes_that_end_inside_a_block(brgemm: BrgemmRows) -> None:
    """Rows sharing 1, 63, 64, 65, 70, 100, 130 and 299 of sequence 0's slots, some sequences only 63 to 65
    long; decodes, 2-token rows (6 queries, vector path) and prefill chunks mixed."""
    if brgemm:
        skip_without_brgemm()
    gen = torch.Generator().manual_seed(6)
    seq_lens = [300, 280, 200, 100, 70, 65, 64, 63, 300, 300]
    pool = PagedPool(seq_lens, torch.bfloat16, 2, 64, gen, 3000, 400)
    share_prefix(pool, {1: (0, 100), 2: (0, 130), 3: (0, 70), 4: (0, 65), 5: (0, 64), 6: (0, 64), 7: (0, 63)})
    share_prefix(pool, {8: (0, 1), 9: (0, 299)})
    q_lens = [1, 2, 40, 1, 2, 1, 64, 1, 1, 9]
    q = torch.randn(sum(q_lens), 6, 64, generator=gen).to(torch.bfloat16)
    _check_rows(pool, q, list(range(10)), seq_lens, q_lens, brgemm)


@pytest.mark.parametrize("brgemm", list(BrgemmRows), ids=["vector", "many", "every"])
def test_a_hundred_decode_rows_over_one_prefix(brgemm: BrgemmRows) -> None:
    """100 decode rows of a GQA group of 3 (300 queries, more than one shared pass holds) over sequence 0's first
    256 slots, each with 2 to 31 keys of its own; every 9th row checked (the last one among them)."""
    if brgemm:
        skip_without_brgemm()
    gen = torch.Generator().manual_seed(100)
    seq_lens = [258 + i % 30 for i in range(100)]
    pool = PagedPool(seq_lens, torch.bfloat16, 2, 64, gen, sum(seq_lens) + 100, 300)
    share_prefix(pool, {i: (0, 256) for i in range(1, 100)})
    q = torch.randn(100, 6, 64, generator=gen).to(torch.bfloat16)
    _check_rows(pool, q, list(range(100)), seq_lens, [1] * 100, brgemm, every=9)


@pytest.mark.parametrize("brgemm", list(BrgemmRows), ids=["vector", "many", "every"])
def test_out_covering_part_of_q(brgemm: BrgemmRows) -> None:
    """``out`` given, a strided view, and rows over tokens 200 and 202..210 of q only: those get the bits a full
    call gives them, every other element of the buffer keeps its 7."""
    if brgemm:
        skip_without_brgemm(128)
    gen = torch.Generator().manual_seed(3)
    seq_lens, q_lens = [513, 300, 300, 65], [200, 1, 1, 9]
    pool = PagedPool(seq_lens, torch.bfloat16, 2, 128, gen, 3000, 600)
    share_prefix(pool, {1: (0, 256)})
    q = torch.randn(sum(q_lens), 10, 128, generator=gen).to(torch.bfloat16)
    full = kernel_attention(pool, q, [0, 1, 2, 3], seq_lens, q_lens, brgemm=brgemm)
    buffer = torch.full((q.shape[0], 10, 256), 7.0, dtype=torch.bfloat16)
    out = buffer[:, :, 64:192]
    rows = pool.req_pool_indices[[1, 3]]
    cpu_kernels.paged_attention(
        q, pool.k, pool.v, pool.req_to_token, rows, index([300, 65]), index([200, 202]), index([1, 9]),
        128**-0.5, out=out, brgemm=brgemm,
    )  # fmt: skip
    assert torch.equal(out[200], full[200])
    assert torch.equal(out[202:], full[202:])
    untouched = torch.ones_like(buffer, dtype=torch.bool)
    untouched[200, :, 64:192] = False
    untouched[202:, :, 64:192] = False
    assert bool((buffer[untouched] == 7).all())


@pytest.mark.parametrize("brgemm", list(BrgemmRows), ids=["vector", "many", "every"])
def test_one_kv_head_of_sixteen_queries_with_large_scores(brgemm: BrgemmRows) -> None:
    """One KV head for 16 query heads (decodes of 16 queries), queries 30 times unit scale (scores in the
    hundreds: the online softmax rescales often), a decode sharing 256 slots with a 100-token chunk's row."""
    if brgemm:
        skip_without_brgemm()
    gen = torch.Generator().manual_seed(16)
    seq_lens, q_lens = [513, 300, 64], [100, 1, 3]
    pool = PagedPool(seq_lens, torch.bfloat16, 1, 64, gen, 1200, 600)
    share_prefix(pool, {1: (0, 256)})
    q = (torch.randn(sum(q_lens), 16, 64, generator=gen) * 30).to(torch.bfloat16)
    _check_rows(pool, q, [0, 1, 2], seq_lens, q_lens, brgemm)
