"""batchgen's C++ paged-attention kernel for the CPU (``torch.ops.batchgen.paged_attention``) and its use by the
torch_native backend.

The kernel is checked against a float64 reference written here, in float32, bfloat16 and float16: ragged
sequence lengths from 1 to 300, rows adding 1 to 5 tokens (causal among them) and prefill-sized rows of up to
40, GQA groups 1/3/4, head dims 64, 128 and 256 (and 40, 16, 52, 60, 80, 96 and 192, which take the kernel's
generic head-size loop and its partial last chunk, or on AVX2 the 8-lane step's shorter last register block),
K/V slots scattered over the pool in random order, and every slot the kernel must not read filled with NaN.
Then: a row's output is bit-identical in any batch, under any thread count and whether its tokens come as one
row or one per row; a query's output is the same alone as beside the other query heads of its GQA group; bad
inputs and failed builds give one clear line; the torch_native backend agrees with itself with the kernel on and
off (``BATCHGEN_CPU_ATTENTION_KERNEL=0``) in DECODE, TARGET_VERIFY and MIXED rounds; and the engine generates the
same greedy tokens both ways, through chunked prefill, MIXED, DECODE and TARGET_VERIFY rounds.

Everything here skips, saying why, when the extension cannot be built on this machine (no compiler or ninja).
"""

from __future__ import annotations

import copy
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from batchgen.environment import kernel_switches
from batchgen.kernels import cpu as cpu_kernels
from batchgen.kernels.attention import torch_native
from batchgen.kernels.attention.torch_native import TorchNativeAttnBackend
from batchgen.kernels.cpu import paged_attention
from batchgen.loop.forward_mode import ForwardMode
from tests.helpers.cli import generate, write_jsonl
from tests.helpers.models import build_random_model
from tests.helpers.paged_pool import PagedPool, index, kernel_attention, pool_reference, relative_error
from tests.helpers.reference import assert_within_rounding_noise, deviation, greedy_rows, hf_float32_rows

_FLAGS = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
POOL_SLOTS = 2500
CONTEXT = 320
# (sequence length, new tokens): one token of a one-token sequence, decodes around the kernel's 16-key and
# 64-key boundaries, verify-like rows of 2-5 tokens, and a 300-token sequence.
ROWS = [(1, 1), (2, 2), (17, 1), (64, 3), (65, 5), (130, 4), (300, 2), (129, 1)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
SHAPES = [
    *[(torch.float32, d, g) for d in (64, 128) for g in (1, 3, 4)],
    *[(dt, d, g) for dt in (torch.bfloat16, torch.float16) for d in (64, 128) for g in (1, 4)],
    (torch.float32, 40, 3),
    (torch.bfloat16, 16, 2),
    (torch.float32, 256, 2),
    # Heads that are no multiple of 64 (AVX2: the last dims in fewer registers) or of 8 (AVX2: the generic path,
    # which must read nothing past a row: the unread slots after each are NaN).
    (torch.bfloat16, 96, 3),
    (torch.float16, 80, 2),
    (torch.float32, 192, 2),
    (torch.bfloat16, 60, 2),
    (torch.float32, 52, 1),
]


@pytest.fixture(scope="module", autouse=True)
def _kernel_built() -> None:
    problem = cpu_kernels.build_problem()
    if problem is not None:
        pytest.skip(f"the C++ kernel cannot be built on this machine: {problem}")


def _shape_id(shape: tuple[torch.dtype, int, int]) -> str:
    dtype, head_dim, group = shape
    return f"{str(dtype).removeprefix('torch.')}-d{head_dim}-g{group}"


def _Pool(seq_lens: list[int], dtype: torch.dtype, num_kv_heads: int, head_dim: int, gen: torch.Generator) -> PagedPool:
    return PagedPool(seq_lens, dtype, num_kv_heads, head_dim, gen, POOL_SLOTS, CONTEXT)


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_kernel_matches_float64(shape: tuple[torch.dtype, int, int]) -> None:
    dtype, head_dim, group = shape
    gen = torch.Generator().manual_seed(head_dim * 10 + group)
    num_kv_heads = 2
    pool = _Pool([n for n, _ in ROWS], dtype, num_kv_heads, head_dim, gen)
    tokens = sum(t for _, t in ROWS)
    # q as the model makes it: a strided view into the fused qkv projection's output.
    qkv = torch.randn(tokens, (num_kv_heads * group + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : num_kv_heads * group * head_dim].view(tokens, num_kv_heads * group, head_dim)
    out = kernel_attention(pool, q, list(range(len(ROWS))), [n for n, _ in ROWS], [t for _, t in ROWS])
    assert out.dtype == dtype and out.shape == q.shape
    start = 0
    for i, (seq_len, new) in enumerate(ROWS):
        ref = pool_reference(q[start : start + new], pool, i, seq_len - new)
        err = relative_error(out[start : start + new], ref)
        assert err <= TOLERANCE[dtype], f"row of length {seq_len} adding {new}: {err}"
        start += new


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_many_queries_match_float64(dtype: torch.dtype) -> None:
    """Prefill-sized rows: more queries (tokens x group) than the kernel handles per work item (64), so a
    row's queries are split over several items, each with its own causal extent."""
    gen = torch.Generator().manual_seed(5)
    rows = [(200, 40), (100, 17), (33, 33)]
    pool = _Pool([n for n, _ in rows], dtype, 2, 64, gen)
    q = torch.randn(sum(t for _, t in rows), 8, 64, generator=gen).to(dtype)
    out = kernel_attention(pool, q, [0, 1, 2], [n for n, _ in rows], [t for _, t in rows])
    start = 0
    for i, (seq_len, new) in enumerate(rows):
        ref = pool_reference(q[start : start + new], pool, i, seq_len - new)
        assert relative_error(out[start : start + new], ref) <= TOLERANCE[dtype], f"row of length {seq_len}"
        start += new


def test_out_keeps_tokens_of_no_row() -> None:
    """With ``out`` given, only the rows' tokens are written: a MIXED round's prefill tokens are left alone."""
    gen = torch.Generator().manual_seed(1)
    pool = _Pool([9, 20], torch.float32, 2, 32, gen)
    q = torch.randn(7, 4, 32, generator=gen)
    out = torch.full_like(q, 7.0)
    # Row 0 adds tokens 1..2, row 1 token 5; tokens 0, 3, 4, 6 belong to no row; a third row adds nothing.
    paged_attention(
        q,
        pool.k,
        pool.v,
        pool.req_to_token,
        pool.req_pool_indices[[0, 1, 1]],
        index([9, 20, 20]),
        index([1, 5, 0]),
        index([2, 1, 0]),
        32**-0.5,
        out,
    )
    assert torch.equal(out[[0, 3, 4, 6]], torch.full((4, 4, 32), 7.0))
    assert relative_error(out[1:3], pool_reference(q[1:3], pool, 0, 7)) < 1e-5
    assert relative_error(out[5:6], pool_reference(q[5:6], pool, 1, 19)) < 1e-5


@pytest.fixture
def _threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("_threads")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_is_bit_identical_in_any_batch(dtype: torch.dtype) -> None:
    """Row 3 (130 tokens, adding 4) alone, among others at another place in the batch, on one thread or two,
    and as four one-token rows (the same queries at the same positions) gives the same bits."""
    gen = torch.Generator().manual_seed(2)
    pool = _Pool([n for n, _ in ROWS], dtype, 2, 64, gen)
    q_row = torch.randn(4, 8, 64, generator=gen).to(dtype)
    alone = kernel_attention(pool, q_row, [5], [130], [4])
    others = torch.randn(12, 8, 64, generator=gen).to(dtype)
    torch.set_num_threads(1)
    one_thread = kernel_attention(pool, q_row, [5], [130], [4])
    torch.set_num_threads(2)
    mixed = torch.cat([others[:7], q_row, others[7:]])  # rows 6 and 3 add 7 tokens before it
    batch = kernel_attention(pool, mixed, [6, 3, 5, 7, 1], [300, 64, 130, 129, 2], [4, 3, 4, 1, 1])
    as_decodes = kernel_attention(pool, q_row, [5, 5, 5, 5], [127, 128, 129, 130], [1, 1, 1, 1])
    assert torch.equal(one_thread, alone)
    assert torch.equal(batch[7:11], alone)
    assert torch.equal(as_decodes, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("group", "head_dim"), [(2, 64), (3, 48), (4, 96), (7, 40), (3, 56)])
def test_query_gives_the_same_bits_alone_as_in_its_gqa_group(dtype: torch.dtype, group: int, head_dim: int) -> None:
    """The query heads of a KV head's group share its K/V reads (on AVX2 up to three at a time, also across the
    tokens of a row while they see the same keys): each query's output equals the one it gives as the only query of
    a one-head pool, one token at a time. Rows: decodes of 17 and 129 keys, and rows adding 4 and 2 tokens; heads
    of 64, 48, 96, 40 and 56 dims (AVX2: 0 to 3 registers of 8 dims after the last whole 32-dim block)."""
    gen = torch.Generator().manual_seed(group)
    pool = _Pool([n for n, _ in ROWS], dtype, 2, head_dim, gen)
    rows, lens, new = [2, 5, 6, 7], [17, 130, 300, 129], [1, 4, 2, 1]
    q = torch.randn(sum(new), 2 * group, head_dim, generator=gen).to(dtype)
    together = kernel_attention(pool, q, rows, lens, new)
    token = 0
    for row, seq_len, added in zip(rows, lens, new):
        for position in range(seq_len - added, seq_len):
            for head in range(2 * group):
                one_head = copy.copy(pool)
                one_head.k, one_head.v = (
                    pool.k[head // group : head // group + 1],
                    pool.v[head // group : head // group + 1],
                )
                alone = kernel_attention(one_head, q[token : token + 1, head : head + 1], [row], [position + 1], [1])
                assert torch.equal(alone[0, 0], together[token, head]), f"row {row}, position {position}, head {head}"
            token += 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_after_a_query_never_reach_it(dtype: torch.dtype) -> None:
    """A row of 6 new tokens whose later V (and K) hold inf or NaN, as a broken model could write: every token
    before them gives the bits it gives decoded alone. (bfloat16 weights V two keys at a time: the pair of a
    query's last key reaches one key past it, whose probability is 0, and 0 x inf is NaN.)"""
    gen = torch.Generator().manual_seed(8)
    pool = _Pool([70], dtype, 2, 64, gen)
    q = torch.randn(6, 4, 64, generator=gen).to(dtype)
    for bad in (65, 66, 67, 69):  # odd and even positions, inside the second 64-key block
        k, v = pool.k.clone(), pool.v.clone()
        pool.v[:, pool.slots[0][bad]] = float("inf")
        pool.k[:, pool.slots[0][bad + 1 :]] = float("nan")
        together = kernel_attention(pool, q, [0], [70], [6])
        for t in range(bad - 64):
            alone = kernel_attention(pool, q[t : t + 1], [0], [65 + t], [1])
            assert torch.equal(together[t], alone[0]), (bad, t)
            assert bool(alone.isfinite().all())
        pool.k, pool.v = k, v


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(k=torch.zeros(2, 50, 32), v=torch.zeros(2, 50, 32)), "k_cache.s head_dim 32 differs from q.s 64"),
        (dict(v=torch.zeros(2, 50, 64, dtype=torch.bfloat16)), "must share one dtype"),
        (dict(q=torch.zeros(3, 5, 64)), "5 heads are not a multiple of the cache's 2 KV heads"),
        (dict(q=torch.zeros(3, 4, 64, dtype=torch.float64)), "float32, bfloat16 or float16"),
        (dict(seq_lens=index([1])), "q_lens \\(2\\) <= seq_lens \\(1\\)"),
        (dict(seq_lens=index([400])), "<= context_len \\(40\\)"),
        (dict(q_starts=index([2])), "its tokens \\[2, 4\\) are outside q's 3 tokens"),
        (dict(rows=index([9])), "req_pool_indices 9 is outside req_to_token's 3 rows"),
        (dict(q_lens=index([1, 1])), "q_lens must be 1-D of length 1"),
        (dict(table=torch.full((3, 40), 50)), "names a KV slot outside \\[0, 50\\)"),
        (dict(table=torch.zeros(3, 40, dtype=torch.int32)), "req_to_token must be int64"),
        (dict(out=torch.zeros(3, 4, 32)), "out must have q's shape"),
    ],
)
def test_bad_inputs_are_clear_errors(change: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = dict(
        q=torch.zeros(3, 4, 64),
        k=torch.zeros(2, 50, 64),
        v=torch.zeros(2, 50, 64),
        table=torch.zeros(3, 40, dtype=torch.int64),
        rows=index([1]),
        seq_lens=index([5]),
        q_starts=index([0]),
        q_lens=index([2]),
        out=None,
    )
    args.update(change)
    with pytest.raises(RuntimeError, match=message) as err:
        paged_attention(
            args["q"],
            args["k"],
            args["v"],
            args["table"],
            args["rows"],
            args["seq_lens"],
            args["q_starts"],
            args["q_lens"],
            0.125,
            args["out"],
        )
    assert "batchgen::paged_attention: " in str(err.value)


def test_switch_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHGEN_CPU_ATTENTION_KERNEL", raising=False)
    assert kernel_switches().cpu_attention_kernel and cpu_kernels.paged_attention_available()
    for off in ("0", "false", "OFF"):
        monkeypatch.setenv("BATCHGEN_CPU_ATTENTION_KERNEL", off)
        assert not kernel_switches().cpu_attention_kernel
    monkeypatch.setenv("BATCHGEN_CPU_ATTENTION_KERNEL", "1")
    assert kernel_switches().cpu_attention_kernel


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads x86 prefetch instructions; this CPU is not x86-64")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils) to read the built kernels")
def test_vector_path_requests_keys_ahead() -> None:
    """The vector path's K/V loads are requested ahead in the built code: GCC deletes the calls of a function that
    only prefetches (it counts a prefetch as no side effect), and prefetch_row must keep them (docs/performance.md,
    machine F)."""
    assert cpu_kernels.paged_attention_available()
    library = next(path for path in torch.ops.loaded_libraries if "batchgen_cpu_kernels" in path)
    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", "-C", library], capture_output=True, text=True, check=True
    ).stdout
    functions = [(f.split("\n", 1)[0], f) for f in re.split(r"\n(?=[0-9a-f]+ <)", listing)]
    loaders = [f for name, f in functions if "load_block<" in name]
    # Where the compiler inlined load_block, its loads sit in the functions that call it.
    loaders = loaders or [f for name, f in functions if "attend<" in name or "attend_shared<" in name]
    assert loaders and all("prefetch" in f for f in loaders)


_COMMAND = "c++ -MMD -MF x.o.d -DTORCH_EXTENSION_NAME=x -fPIC -std=c++20 -c paged_attention.cpp -o x.o"


@pytest.mark.parametrize(
    ("log", "reason"),
    [
        (  # a compile error
            f"Error building extension 'x': [1/2] {_COMMAND}\nFAILED: x.o\n{_COMMAND}\n"
            "paged_attention.cpp:9:10: fatal error: x.h: No such file or directory\ncompilation terminated.\n"
            "ninja: build stopped: subcommand failed.\n",
            "paged_attention.cpp:9:10: fatal error: x.h: No such file or directory",
        ),
        (  # no compiler
            f"Error building extension 'x': [1/2] {_COMMAND}\nFAILED: x.o\n{_COMMAND}\n"
            "/bin/sh: 1: c++: not found\nninja: build stopped: subcommand failed.\n",
            "/bin/sh: 1: c++: not found",
        ),
        ("Ninja is required to load C++ extensions (pip install ninja to get it)", "Ninja is required"),
    ],
    ids=["compile-error", "no-compiler", "no-ninja"],
)
def test_build_failure_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: Any, log: str, reason: str) -> None:
    """torch raises a failed build with the whole ninja log; batchgen says why in one line, once."""
    from torch.utils import cpp_extension

    def fail(**kwargs: Any) -> None:
        raise RuntimeError(log)

    monkeypatch.setattr(cpp_extension, "load", fail)
    problem = cpu_kernels.build_problem.__wrapped__()  # uncached: the real build already happened
    assert problem is not None and problem.startswith(f"the CPU kernels did not build ({reason}")
    err = capsys.readouterr().err
    assert (
        err == f"batchgen: {problem}; using the slower PyTorch code (BATCHGEN_CPU_ATTENTION_KERNEL=0, "
        "BATCHGEN_CPU_FUSED_OPS=0 and BATCHGEN_CPU_HALF_WEIGHT_LINEAR=0 hide this)\n"
    )


# A child process that loads the kernels after a build was killed holding torch's `lock` file (as SIGKILL leaves it).
_LOAD_AFTER_A_KILLED_BUILD = """
import sys
from pathlib import Path
from torch.utils import cpp_extension
from batchgen.kernels import cpu
build_dir = Path(cpp_extension._get_build_directory(cpu._build_name(), verbose=False))
(build_dir / "lock").touch()
assert cpu.build_problem() is None
assert not (build_dir / "lock").exists()
"""


def test_a_build_killed_holding_the_lock_does_not_hang_the_next_run() -> None:
    """torch's builder waits for its ``lock`` file to go, forever; the one a killed build left is removed."""
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_AFTER_A_KILLED_BUILD], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr


def _batch(pool: PagedPool, mode: ForwardMode, rows: list[int], prefix: list[int], extend: list[int]) -> Any:
    """The parts of a ForwardBatch the torch_native backend reads, for sequences ``rows`` of the pool."""
    seq_lens = [p + e for p, e in zip(prefix, extend)]
    is_decode = mode == ForwardMode.DECODE
    return SimpleNamespace(
        forward_mode=mode,
        batch_size=len(rows),
        req_pool_indices=pool.req_pool_indices[rows],
        req_pool_indices_cpu=pool.req_pool_indices[rows].tolist(),
        seq_lens=index(seq_lens),
        max_seq_len=max(seq_lens),
        extend_prefix_lens_cpu=None if is_decode else prefix,
        extend_seq_lens_cpu=None if is_decode else extend,
        req_to_token_pool=SimpleNamespace(req_to_token=pool.req_to_token),
        token_to_kv_pool=SimpleNamespace(k_buffer=pool.k[None], v_buffer=pool.v[None]),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("mode", "prefix", "extend"),
    [
        (ForwardMode.DECODE, [0, 1, 16, 63, 129, 299], [1, 1, 1, 1, 1, 1]),
        (ForwardMode.TARGET_VERIFY, [0, 60, 125, 295], [1, 5, 5, 5]),
        # Prefill chunks (SDPA, or the kernel where prefill_rows_supported says so) beside decode rows.
        (ForwardMode.MIXED, [0, 1, 100, 299], [17, 1, 30, 1]),
    ],
)
def test_backend_same_with_kernel_on_and_off(
    monkeypatch: pytest.MonkeyPatch, mode: ForwardMode, prefix: list[int], extend: list[int], dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(4)
    seq_lens = [p + e for p, e in zip(prefix, extend)]
    pool = _Pool(seq_lens, dtype, 2, 64, gen)
    fb = _batch(pool, mode, list(range(len(seq_lens))), prefix, extend)
    q = torch.randn(sum(extend), 6, 64, generator=gen).to(dtype)
    calls: list[int] = []
    kernel = torch_native.paged_attention

    def spy(*args: Any) -> torch.Tensor:
        calls.append(len(args[4]))
        return kernel(*args)

    monkeypatch.setattr(torch_native, "paged_attention", spy)
    outputs = []
    for switch in ("1", "0"):
        monkeypatch.setenv("BATCHGEN_CPU_ATTENTION_KERNEL", switch)
        backend = TorchNativeAttnBackend(kernel_switches().cpu_attention_kernel)
        backend.init_forward_metadata(fb)
        is_decode = mode == ForwardMode.DECODE
        outputs.append(backend.forward_decode(q, 0, fb) if is_decode else backend.forward_extend(q, 0, fb))
    monkeypatch.setenv("BATCHGEN_CPU_ATTENTION_KERNEL", "1")
    kernel_rows = sum(e <= torch_native.SHORT_ROW_TOKENS for e in extend)
    if cpu_kernels.prefill_rows_supported(dtype, 64):
        kernel_rows = len(extend)
    assert calls == [kernel_rows]  # the kernel ran when on (over the short rows, or all), not when off
    start = 0
    for i, (p, e) in enumerate(zip(prefix, extend)):
        ref = pool_reference(q[start : start + e], pool, i, p)
        for out in outputs:
            assert relative_error(out[start : start + e], ref) <= TOLERANCE[dtype], f"prefix {p}, extend {e}"
        start += e


def test_prefill_rows_go_to_the_kernel_where_it_beats_sdpa() -> None:
    """Prefill rows go to the kernel exactly where it beats SDPA, by the CPU's flags (``/proc/cpuinfo``): in
    bfloat16 with head sizes a multiple of 32 up to 256 where it has avx512_bf16 (vdpbf16ps, and brgemm's bfloat16
    kernels on it or on AMX tiles, which the kernel's ``brgemm`` path asks for); in bfloat16 of any head size on
    AVX-512 without avx512_bf16 or AMX (the generic 16-lane path); in bfloat16 with head sizes a multiple of 8 where
    the CPU has AVX2, FMA and F16C and no AVX-512 (the 8-lane block step); never in float32 or float16."""
    has_dot = " avx512_bf16" in _FLAGS and " avx512bw" in _FLAGS
    generic = " avx512f" in _FLAGS and " avx512_bf16" not in _FLAGS and " amx_tile" not in _FLAGS
    avx2 = all(f" {flag} " in f"{_FLAGS} " for flag in ("avx2", "fma", "f16c")) and " avx512f" not in _FLAGS
    assert bool(torch.ops.batchgen.has_bf16_dot_product()) == has_dot
    assert bool(torch.ops.batchgen.has_avx2_block()) == avx2
    assert cpu_kernels.brgemm_bf16_supported() == has_dot
    assert cpu_kernels.brgemm_attention_supported(torch.bfloat16, 64) == has_dot
    for head_dim in (64, 256):
        assert cpu_kernels.prefill_rows_supported(torch.bfloat16, head_dim) == (has_dot or generic or avx2)
    for head_dim in (80, 512):
        assert cpu_kernels.prefill_rows_supported(torch.bfloat16, head_dim) == (generic or avx2)
    assert cpu_kernels.prefill_rows_supported(torch.bfloat16, 36) == generic
    for dtype, head_dim in [(torch.bfloat16, 80), (torch.bfloat16, 512), (torch.float32, 64), (torch.float16, 64)]:
        assert not cpu_kernels.brgemm_attention_supported(dtype, head_dim)
    assert not cpu_kernels.prefill_rows_supported(torch.float32, 64)
    assert not cpu_kernels.prefill_rows_supported(torch.float16, 64)


# Run in a child process: the kernel built for a lesser CPU (the flag in argv[1]), on the inputs the parent saved.
# Its own process, since one process can load the batchgen op library once only.
_LESSER_BUILD = """
import sys, torch
from batchgen.kernels import cpu
cpu._CFLAGS.append(sys.argv[1])
assert cpu.build_problem() is None
assert not torch.ops.batchgen.has_bf16_dot_product()
torch.save(cpu.paged_attention(*torch.load(sys.argv[2])), sys.argv[3])
"""


@pytest.mark.parametrize(
    ("flag", "dtype"),
    [("-mno-avx512bf16", torch.bfloat16), ("-mno-avx512f", torch.bfloat16), ("-mno-avx512f", torch.float16)],
)
def test_paths_of_lesser_cpus_match_float64(flag: str, dtype: torch.dtype, tmp_path: Path) -> None:
    """The tests above run the best path this CPU has; this builds the kernel as for CPUs with less and checks
    their paths against the same float64 reference: without AVX512-BF16 the generic 16-lane path, without
    AVX-512 at all the 8-lane AVX2 path (attention_avx2.h)."""
    if flag == "-mno-avx512bf16" and not torch.ops.batchgen.has_bf16_dot_product():
        pytest.skip("this CPU has no AVX512-BF16: the tests above already ran the generic bfloat16 path")
    if flag == "-mno-avx512f" and " avx512f" not in _FLAGS:
        pytest.skip("this CPU has no AVX-512: the tests above already ran the AVX2 path")
    if flag == "-mno-avx512f" and not all(f" {f}" in _FLAGS for f in ("avx2", "fma", "f16c")):
        pytest.skip("this CPU has no AVX2, FMA and F16C: the AVX2 path cannot run here")
    gen = torch.Generator().manual_seed(6)
    rows = [(200, 40), (65, 5), (130, 1), (1, 1)]
    pool = _Pool([n for n, _ in rows], dtype, 2, 64, gen)
    q = torch.randn(sum(t for _, t in rows), 8, 64, generator=gen).to(dtype)
    new = [t for _, t in rows]
    args = (
        q,
        pool.k,
        pool.v,
        pool.req_to_token,
        pool.req_pool_indices[[0, 1, 2, 3]],
        index([n for n, _ in rows]),
        index([sum(new[:i]) for i in range(len(new))]),
        index(new),
        64**-0.5,
    )
    torch.save(args, tmp_path / "args.pt")
    subprocess.run(
        [sys.executable, "-c", _LESSER_BUILD, flag, str(tmp_path / "args.pt"), str(tmp_path / "out.pt")],
        check=True,
        timeout=600,
    )
    out = torch.load(tmp_path / "out.pt")
    start = 0
    for i, (seq_len, n) in enumerate(rows):
        ref = pool_reference(q[start : start + n], pool, i, seq_len - n)
        assert relative_error(out[start : start + n], ref) <= TOLERANCE[dtype], f"row of length {seq_len}"
        start += n


def _repetitive_rows() -> list[dict[str, Any]]:
    """Prompts that repeat a motif (so n-gram drafts get accepted) and plain ones, of 1 to 40 tokens."""
    rows = []
    for n in (1, 6, 19, 40):
        motif = [(7 * n + 3 * j) % 290 + 2 for j in range(4)]
        rows.append({"id": f"rep{n}", "prompt_token_ids": [0] + (motif * 10)[: n - 1]})
        rows.append({"id": f"plain{n}", "prompt_token_ids": [0] + [(11 * n + 5 * j) % 290 + 2 for j in range(n - 1)]})
    for row in rows:
        row.update(max_new_tokens=12, temperature=0, ignore_eos=True)
    return rows


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
def test_engine_greedy_same_with_kernel_on_and_off(
    random_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, speculative: bool
) -> None:
    """Same greedy tokens, logprobs within 1e-5 (fp32), through chunked prefill, MIXED and DECODE rounds, and
    TARGET_VERIFY rounds with n-gram speculation; the kernel must have run when on."""
    rows = _repetitive_rows()
    dataset = write_jsonl(tmp_path / "p.jsonl", rows)
    args = ["--chunked-prefill-size", "8", "--max-running-requests", "4"]
    if speculative:
        args += ["--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "4"]
        args += ["--speculative-ngram-min", "1"]
    modes: list[ForwardMode] = []
    calls: list[ForwardMode] = []
    plan = TorchNativeAttnBackend.init_forward_metadata
    kernel = torch_native.paged_attention

    def plan_spy(self: TorchNativeAttnBackend, forward_batch: Any) -> None:
        modes.append(forward_batch.forward_mode)
        plan(self, forward_batch)

    def kernel_spy(*call: Any) -> torch.Tensor:
        calls.append(modes[-1])
        return kernel(*call)

    monkeypatch.setattr(TorchNativeAttnBackend, "init_forward_metadata", plan_spy)
    monkeypatch.setattr(torch_native, "paged_attention", kernel_spy)
    monkeypatch.setenv("BATCHGEN_CPU_ATTENTION_KERNEL", "0")
    gathered = generate(dataset, tmp_path / "off.arrow", random_models["llama"], *args)
    assert not calls
    monkeypatch.setenv("BATCHGEN_CPU_ATTENTION_KERNEL", "1")
    in_place = generate(dataset, tmp_path / "on.arrow", random_models["llama"], *args)
    expected = {ForwardMode.MIXED, ForwardMode.DECODE}
    if speculative:
        expected = {ForwardMode.MIXED, ForwardMode.TARGET_VERIFY}  # decodes become verify rounds
    assert expected <= set(calls), set(calls)
    for row in rows:
        want, got = gathered[row["id"]], in_place[row["id"]]
        assert got["output_token_ids"] == want["output_token_ids"], row["id"]
        assert len(got["output_token_ids"]) == 12
        for a, b in zip(got["output_logprobs"], want["output_logprobs"]):
            assert abs(a - b) <= 1e-5, row["id"]


def test_bfloat16_engine_within_rounding_noise_of_hf_float32(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A head-64 model in bfloat16 with batchgen's CPU kernels (attention: on a CPU with AVX512-BF16 every row,
    prefill chunks included, through vdpbf16ps; the fused RMSNorm, SiLU-and-multiply and RoPE) deviates from HF's
    float32 greedy run no more than bfloat16 rounding does in plain PyTorch (SDPA and gathered K/V, the torch
    elementwise code): the rule of ``assert_within_rounding_noise``."""
    model_dir = build_random_model(
        tmp_path / "m", "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2
    )
    rows = greedy_rows((20, 47, 90, 130, 160, 200), 16, seed=3)
    dataset = write_jsonl(tmp_path / "p.jsonl", rows)
    reference = hf_float32_rows(model_dir, rows, 16)
    args = ["--dtype", "bfloat16", "--chunked-prefill-size", "64", "--max-running-requests", "4"]
    monkeypatch.setenv("BATCHGEN_CPU_ATTENTION_KERNEL", "0")
    monkeypatch.setenv("BATCHGEN_CPU_FUSED_OPS", "0")
    noise = deviation(reference, generate(dataset, tmp_path / "off.arrow", model_dir, *args))
    monkeypatch.setenv("BATCHGEN_CPU_ATTENTION_KERNEL", "1")
    monkeypatch.setenv("BATCHGEN_CPU_FUSED_OPS", "1")
    kernel = deviation(reference, generate(dataset, tmp_path / "on.arrow", model_dir, *args))
    assert_within_rounding_noise(kernel, noise, "bfloat16 with the CPU kernel")
