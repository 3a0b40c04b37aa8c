"""The C++ paged-attention kernel's brgemm path (PyTorch's brgemm on AMX tiles or AVX512-BF16, ``brgemm=MANY``)
and its reading of a prefix shared by several rows once for all of them.

brgemm: against the float64 reference in bfloat16 (head sizes 64, 128 and 256, GQA groups 1, 3 and 4, rows
from 2 to 300 keys adding 2 to 70 tokens, decodes beside them), with NaN in every slot it must not read and inf or
NaN in the keys after a query; a row's output is the same bits alone, among other rows, on one thread or two, and
split into rows of other sizes that still take brgemm. Tests of it skip, saying so, where brgemm has no bfloat16.

Shared prefixes: rows whose first slots are the same (as the prefix cache hands them out) give the bits they give
alone, on each path this CPU has (the dot-product, brgemm and vector paths, float32, bfloat16 and float16),
with prefixes shared by two to five rows over 1 to 4 whole blocks of keys, on one thread or two.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from batchgen.kernels.cpu import BrgemmRows
from tests.helpers.paged_pool import (
    PagedPool,
    kernel_attention,
    pool_reference,
    relative_error,
    share_prefix,
    skip_without_brgemm,
    skip_without_cpu_kernel,
)

MANY, EVERY = BrgemmRows.MANY_QUERIES, BrgemmRows.EVERY_ROW
_FLAGS = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
TOLERANCE = 2e-2  # bfloat16 inputs, probabilities rounded to bfloat16


@pytest.fixture(scope="module", autouse=True)
def _kernel_built() -> None:
    skip_without_cpu_kernel()


@pytest.fixture
def _threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _pool(seq_lens: list[int], num_kv_heads: int, head_dim: int, gen: torch.Generator) -> PagedPool:
    return PagedPool(seq_lens, torch.bfloat16, num_kv_heads, head_dim, gen, 4000, 400)


def _check(out: torch.Tensor, q: torch.Tensor, pool: PagedPool, rows: list[tuple[int, int]]) -> None:
    start = 0
    for i, (seq_len, new) in enumerate(rows):
        ref = pool_reference(q[start : start + new], pool, i, seq_len - new)
        err = relative_error(out[start : start + new], ref)
        assert err <= TOLERANCE, f"row of length {seq_len} adding {new}: {err}"
        start += new


# (sequence length, new tokens): prefill chunks without and with a cached prefix, a whole prompt, verify-sized rows
# and decodes (these take the vector path).
MATRIX_ROWS = [(2, 2), (70, 70), (300, 40), (257, 9), (256, 3), (129, 5), (90, 1), (300, 1)]


@pytest.mark.parametrize("brgemm", [MANY, EVERY], ids=["many", "every"])
@pytest.mark.parametrize(("head_dim", "group"), [(64, 1), (64, 3), (64, 4), (128, 3), (256, 2)])
def test_brgemm_matches_float64(head_dim: int, group: int, brgemm: BrgemmRows) -> None:
    skip_without_brgemm(head_dim)
    gen = torch.Generator().manual_seed(head_dim + group)
    pool = _pool([n for n, _ in MATRIX_ROWS], 2, head_dim, gen)
    q = torch.randn(sum(t for _, t in MATRIX_ROWS), 2 * group, head_dim, generator=gen).to(torch.bfloat16)
    out = kernel_attention(pool, q, list(range(len(MATRIX_ROWS))), *map(list, zip(*MATRIX_ROWS)), brgemm=brgemm)
    _check(out, q, pool, MATRIX_ROWS)


@pytest.mark.usefixtures("_threads")
@pytest.mark.parametrize("brgemm", [MANY, EVERY], ids=["many", "every"])
def test_brgemm_row_is_bit_identical_in_any_batch(brgemm: BrgemmRows) -> None:
    """A 40-token row (4 query heads per KV head: 160 queries, three work items) alone, on one thread, among other
    rows, and as rows of 2 and 5 tokens (8 and 20 queries, still on brgemm) gives the same bits; with every row
    through brgemm also as 40 rows of 1 token (4 queries) beside others sharing its cache."""
    skip_without_brgemm()
    gen = torch.Generator().manual_seed(2)
    pool = _pool([300, 200, 64], 2, 64, gen)
    q_row = torch.randn(40, 8, 64, generator=gen).to(torch.bfloat16)
    alone = kernel_attention(pool, q_row, [0], [300], [40], brgemm=brgemm)
    torch.set_num_threads(1)
    one_thread = kernel_attention(pool, q_row, [0], [300], [40], brgemm=brgemm)
    torch.set_num_threads(2)
    others = torch.randn(13, 8, 64, generator=gen).to(torch.bfloat16)
    mixed = torch.cat([others[:12], q_row, others[12:]])
    batch = kernel_attention(pool, mixed, [1, 2, 0, 1], [200, 64, 300, 150], [9, 3, 40, 1], brgemm=brgemm)
    pairs = kernel_attention(pool, q_row, [0] * 20, [262 + 2 * i for i in range(20)], [2] * 20, brgemm=brgemm)
    fives = kernel_attention(pool, q_row, [0] * 8, [265 + 5 * i for i in range(8)], [5] * 8, brgemm=brgemm)
    splits = [one_thread, batch[12:52], pairs, fives]
    if brgemm == EVERY:
        splits.append(kernel_attention(pool, q_row, [0] * 40, [261 + i for i in range(40)], [1] * 40, brgemm=brgemm))
    for other in splits:
        assert torch.equal(other, alone)


@pytest.mark.usefixtures("_threads")
@pytest.mark.parametrize(("seq_len", "new"), [(224, 224), (380, 124), (260, 40)], ids=["block0", "block1", "across"])
def test_a_query_gives_its_bits_whatever_keys_its_row_has_after_it(seq_len: int, new: int) -> None:
    """The GEMMs of a block run over its keys rounded up to 32: a prefill row's query (whose block runs to the
    row's last key) and the same query as a decode row of its own (whose block ends at the query) run over
    different key counts. With every row through brgemm each query of the row gives the same bits either way, at
    every position of the sweep (both sides of each 32-key step, in the first block, the second, and across them)."""
    skip_without_brgemm()
    gen = torch.Generator().manual_seed(seq_len)
    pool = _pool([seq_len], 2, 64, gen)
    q = torch.randn(new, 6, 64, generator=gen).to(torch.bfloat16)
    together = kernel_attention(pool, q, [0], [seq_len], [new], brgemm=EVERY)
    first = seq_len - new
    for threads in (1, 2):
        torch.set_num_threads(threads)
        one_each = kernel_attention(pool, q, [0] * new, [first + i + 1 for i in range(new)], [1] * new, brgemm=EVERY)
        assert torch.equal(one_each.view(torch.int16), together.view(torch.int16))
    _check(together, q, pool, [(seq_len, new)])


@pytest.mark.parametrize("position", [287, 511], ids=["mid-block", "block-end"])
def test_a_zero_output_has_one_sign_whatever_keys_its_row_has_after_it(position: int) -> None:
    """A query whose first output dim sums to zero: its earlier block's weight underflows to 0 (its scores 160 below
    the next block's), so that block's negative values leave -0, and its own block's values there are a zero and
    two tiny ones whose products flush to -0 (vdpbf16ps flushes denormals). As its own decode row nothing follows
    them; in a prefill row 32 more keys add 0 x V = +0, and -0 + +0 = +0. The output is +0 (IEEE 754 bits 0x0000)
    both ways."""
    skip_without_brgemm()
    seq_len = position + 33
    pool = PagedPool([seq_len], torch.bfloat16, 1, 64, torch.Generator().manual_seed(0), 800, 600)
    slots = pool.slots[0]
    block = position // 256 * 256
    pool.k[:, slots] = 0.0
    pool.k[:, slots[block:]] = 20.0  # q . k = 20 x 64 x 1/8 = 160 above the earlier block's 0
    pool.v[:, slots] = 1.0
    pool.v[:, slots[:block], 0] = -1.0
    pool.v[:, slots[block : position + 1], 0] = 0.0
    pool.v[:, slots[position - 1], 0] = -(2.0**-125)
    pool.v[:, slots[position], 0] = 1.5 * 2.0**-126
    q = torch.ones(seq_len, 1, 64, dtype=torch.bfloat16)
    alone = kernel_attention(pool, q[position : position + 1], [0], [position + 1], [1], brgemm=EVERY)
    in_row = kernel_attention(pool, q[position:], [0], [seq_len], [33], brgemm=EVERY)[:1]
    assert alone[0, 0, 0].view(torch.int16).item() == 0
    assert in_row[0, 0, 0].view(torch.int16).item() == 0
    assert torch.equal(alone.view(torch.int16), in_row.view(torch.int16))


def test_brgemm_keys_after_a_query_never_reach_it() -> None:
    """Keys after a query's position holding inf (V) and NaN (K), as a broken model could write them: the tokens
    before give the bits they give without them."""
    skip_without_brgemm()
    gen = torch.Generator().manual_seed(8)
    pool = _pool([300], 2, 64, gen)
    q = torch.randn(20, 4, 64, generator=gen).to(torch.bfloat16)
    clean = kernel_attention(pool, q, [0], [300], [20], brgemm=MANY)
    k, v = pool.k.clone(), pool.v.clone()
    for bad in (290, 291):  # the 20 tokens sit at positions 280..299
        pool.v[:, pool.slots[0][bad]] = float("inf")
        pool.k[:, pool.slots[0][bad + 1 :]] = float("nan")
        dirty = kernel_attention(pool, q, [0], [300], [20], brgemm=MANY)
        assert torch.equal(dirty[: bad - 280], clean[: bad - 280])
        assert bool(dirty[: bad - 280].isfinite().all())
        pool.k, pool.v = k.clone(), v.clone()


def test_brgemm_refused_where_it_cannot_run() -> None:
    pool = PagedPool([10], torch.float32, 2, 64, torch.Generator().manual_seed(1), 50, 20)
    for brgemm in (MANY, EVERY):
        with pytest.raises(RuntimeError, match="brgemm must be 0, 1 or 2, and 1 and 2 need bfloat16"):
            kernel_attention(pool, torch.zeros(2, 4, 64), [0], [10], [2], brgemm=brgemm)
    with pytest.raises(RuntimeError, match="brgemm must be 0, 1 or 2"):
        kernel_attention(pool, torch.zeros(2, 4, 64), [0], [10], [2], brgemm=3)  # type: ignore[arg-type]


# (dtype, head size): bfloat16 takes the dot-product path where the CPU has AVX512-BF16 and the vector path
# elsewhere; float32 and float16 always the vector path, a head of 36 dims its generic block step on AVX2 too.
_SHARING_PATHS = [(torch.bfloat16, 64), (torch.float32, 64), (torch.float16, 64), (torch.float32, 36)]

# Ten rows over one pool: rows 1-4 share row 0's first 300 slots (4 blocks of 64 keys, 1 of 256), rows 5-6 its
# first 64, rows 7-8 one another's first 200; row 9 shares nothing. Each decodes one token, except row 3 (two: six
# queries with a group of 3) and row 8 (30).
_SHARING_LENS = [300, 280, 257, 320, 300, 65, 128, 210, 230, 150]
_SHARES = {1: (0, 300), 2: (0, 300), 3: (0, 300), 4: (0, 300), 5: (0, 64), 6: (0, 64), 8: (7, 200)}
_SHARING_NEW = [1, 1, 1, 2, 1, 1, 1, 1, 30, 1]


def _sharing_pool(dtype: torch.dtype, head_dim: int, group: int) -> tuple[PagedPool, torch.Tensor]:
    """The sequences of _SHARING_LENS sharing as _SHARES says, and random queries of a GQA group of ``group`` for
    their new tokens (_SHARING_NEW)."""
    gen = torch.Generator().manual_seed(group)
    pool = PagedPool(_SHARING_LENS, dtype, 2, head_dim, gen, 4000, 400)
    share_prefix(pool, _SHARES)
    return pool, torch.randn(sum(_SHARING_NEW), 2 * group, head_dim, generator=gen).to(dtype)


def _assert_rows_alone(together: torch.Tensor, pool: PagedPool, q: torch.Tensor, brgemm: BrgemmRows) -> None:
    """Each row of the _SHARING_LENS call gives the bits it gives alone."""
    start = 0
    for row, (n, t) in enumerate(zip(_SHARING_LENS, _SHARING_NEW)):
        alone = kernel_attention(pool, q[start : start + t], [row], [n], [t], brgemm=brgemm)
        assert torch.equal(together[start : start + t], alone), f"row {row}"
        start += t


@pytest.mark.usefixtures("_threads")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize(("dtype", "head_dim"), _SHARING_PATHS, ids=["bf16", "f32", "f16", "f32-dim36"])
def test_rows_sharing_a_prefix_give_the_bits_they_give_alone(
    dtype: torch.dtype, head_dim: int, group: int, threads: int
) -> None:
    """The rows of _SHARES without brgemm: every row's output equals the one it gives alone, and matches float64.
    With two threads the kernel caps the queries of a group of sharing rows (to leave each thread two work items),
    with one it does not: the bits are the same either way."""
    torch.set_num_threads(threads)
    pool, q = _sharing_pool(dtype, head_dim, group)
    together = kernel_attention(pool, q, list(range(10)), _SHARING_LENS, _SHARING_NEW)
    _assert_rows_alone(together, pool, q, BrgemmRows.NEVER)
    _check(together, q, pool, list(zip(_SHARING_LENS, _SHARING_NEW)))


@pytest.mark.usefixtures("_threads")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("group", [1, 3])
def test_brgemm_runs_rows_sharing_a_prefix_as_gemms(group: int, threads: int) -> None:
    """The rows of _SHARES with brgemm, in bfloat16: rows 0-4 share a whole block of 256 keys, which runs as GEMMs
    over all their queries, then each goes on alone. Every row matches float64; on one thread rows 0-4 differ from
    the vector path's bits somewhere (they took the GEMMs); the other rows of a few queries equal them, and rows of
    8 queries or more give the bits they give alone."""
    skip_without_brgemm()
    torch.set_num_threads(threads)
    pool, q = _sharing_pool(torch.bfloat16, 64, group)
    rows = list(range(10))
    together = kernel_attention(pool, q, rows, _SHARING_LENS, _SHARING_NEW, brgemm=MANY)
    vector = kernel_attention(pool, q, rows, _SHARING_LENS, _SHARING_NEW)
    _check(together, q, pool, list(zip(_SHARING_LENS, _SHARING_NEW)))
    start = 0
    for row, (n, t) in enumerate(zip(_SHARING_LENS, _SHARING_NEW)):
        got = together[start : start + t]
        if t * group >= 8:
            assert torch.equal(got, kernel_attention(pool, q[start : start + t], [row], [n], [t], brgemm=MANY))
        elif row > 4 or threads == 1:  # two threads cap a group's queries, so a row of 0-4 may be left alone
            assert torch.equal(got, vector[start : start + t]) == (row > 4), f"row {row}"
        start += t


@pytest.mark.usefixtures("_threads")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("group", [1, 3])
def test_every_row_through_brgemm_gives_the_bits_it_gives_alone(group: int, threads: int) -> None:
    """The rows of _SHARES with every row through brgemm (``--deterministic``), in bfloat16: rows 0-4 share a whole
    block of 256 keys as GEMMs over all their queries and go on through the GEMMs alone; every row, grouped or not,
    of one query or thirty, gives the bits it gives alone, and matches float64."""
    skip_without_brgemm()
    torch.set_num_threads(threads)
    pool, q = _sharing_pool(torch.bfloat16, 64, group)
    together = kernel_attention(pool, q, list(range(10)), _SHARING_LENS, _SHARING_NEW, brgemm=EVERY)
    _check(together, q, pool, list(zip(_SHARING_LENS, _SHARING_NEW)))
    _assert_rows_alone(together, pool, q, EVERY)
