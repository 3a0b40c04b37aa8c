"""C++ kernels for the CPU, JIT-built with ``torch.utils.cpp_extension`` on first use and cached.

``paged_attention.cpp`` registers ``torch.ops.batchgen.paged_attention``: attention that reads each request's
K/V in place from the paged pool through ``req_to_token`` (no gathered copy), as SGLang's and vLLM's CPU
backends do. The torch_native backend uses it for decode and verify rows on CPU tensors when it builds here,
and for bfloat16 prefill rows on a CPU with AVX-512 or AVX2 (:func:`prefill_rows_supported`): through brgemm
where it runs bfloat16 (``attention_brgemm.h``: AMX tiles or ``vdpbf16ps``), else on ``vdpbf16ps`` or the vector path.
``elementwise.cpp`` registers the fused RMSNorm, SiLU-and-multiply and RoPE of bfloat16 models
(:mod:`batchgen.kernels.cpu.fused_elementwise`), ``sampling.cpp`` greedy sampling's argmax, the exponential race
of random sampling and log_softmax at the ids read (:mod:`batchgen.kernels.cpu.sampling_ops`), ``half_linear.cpp``
linear layers on half-precision weights in float32 (:mod:`batchgen.kernels.cpu.half_linear`), ``decode_layers.cpp``
the decoder layers of a decode round in one call (:mod:`batchgen.kernels.cpu.decode_layers`),
``brgemm_linear.cpp`` bfloat16 linear layers whose rows do not depend on each other (``--deterministic``;
:mod:`~batchgen.kernels.cpu.brgemm_linear`, ``dot_tiles.h``); ``vec16.h`` holds the vector helpers they share.

The build needs a C++ compiler and ninja; it compiles once per machine with ``-O3 -march=native`` (about 10 s
on 2 cores) into torch's extension cache (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``),
in a folder named by a hash of the sources, the flags, the torch and Python versions and this CPU's model and
instruction-set flags, so a cache shared between machines never loads code built for another CPU; later
processes load it in ~0.1 s (a build says so on stderr, before and after). If it cannot build, batchgen says why in
one line on stderr and runs plain PyTorch instead. ``BATCHGEN_CPU_ATTENTION_KERNEL=0`` turns the attention kernel
off, ``BATCHGEN_CPU_FUSED_OPS=0`` the fused ops, ``BATCHGEN_CPU_HALF_WEIGHT_LINEAR=0`` the half-weight linear
layers (:class:`batchgen.kernels.switches.KernelSwitches`); with all three off nothing is built, unless
``--deterministic`` runs a bfloat16 model's linear layers on ``brgemm_linear.cpp``.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import functools
import hashlib
import logging
import platform
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

_SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "paged_attention.cpp",
        "elementwise.cpp",
        "sampling.cpp",
        "half_linear.cpp",
        "decode_layers.cpp",
        "brgemm_linear.cpp",
    )
]
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # included by the sources: part of the build's key
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]


class BrgemmRows(enum.IntEnum):
    """Which rows :func:`paged_attention` runs as GEMMs through brgemm (where
    :func:`brgemm_attention_supported`); the others run on the vector path. Within a path a query's bits never
    depend on the other rows; across paths they differ in the last bits (the order of the sums).

    - ``NEVER``: none.
    - ``MANY_QUERIES``: rows of 8 queries or more (new tokens times the GQA group: prefill chunks, verify rows), and
      the whole 256-key blocks that decode rows sharing a cached prefix share: a decode's bits then depend on
      whether rows sharing its prefix run beside it, and how many of them a group takes (which the thread count
      caps). The fastest.
    - ``EVERY_ROW``: every row, each in the same 256-key blocks whatever its size or company, so a query's bits
      depend on its own inputs alone, as on the vector path (what ``--deterministic`` runs).
    """

    NEVER = 0
    MANY_QUERIES = 1
    EVERY_ROW = 2


def paged_attention_available() -> bool:
    """Whether :func:`paged_attention` can run: built (the first call builds it, once per process). Whether it
    should is the caller's ``KernelSwitches.cpu_attention_kernel``."""
    return build_problem() is None


@functools.cache
def prefill_rows_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether rows of many new tokens (prefill chunks) should go to the kernel too, rather than to SDPA over
    gathered K/V: where the kernel runs them through brgemm (:func:`brgemm_attention_supported`); in bfloat16 on a
    CPU without AMX: on ``vdpbf16ps`` with AVX512-BF16 (head sizes a multiple of 32, up to 256), else on its float32
    vector path, 16 lanes on AVX-512 or AVX2's 8-lane block step (head sizes a multiple of 8). Each beats SDPA there
    (docs/performance.md, machines A, D, E and F); elsewhere (no AVX2, float32 models) SDPA keeps them."""
    if brgemm_attention_supported(dtype, head_dim):
        return True
    if dtype != torch.bfloat16 or has_amx() or not paged_attention_available():
        return False
    if torch.ops.batchgen.has_bf16_dot_product():
        return head_dim % 32 == 0 and head_dim <= 256
    if torch.ops.batchgen.has_avx2_block():
        return head_dim % 8 == 0
    return bool(torch.cpu._is_avx512_supported())


@functools.cache
def brgemm_bf16_supported() -> bool:
    """Whether PyTorch's brgemm (oneDNN's batch-reduce GEMM ukernel) runs bfloat16 here, tried once with a tiny
    call: AMX tiles or AVX512-BF16, and the kernels built. :mod:`batchgen.kernels.cpu.brgemm_linear` and the
    attention kernel's brgemm path need it."""
    return build_problem() is None and bool(torch.ops.batchgen.brgemm_bf16_runs())


@functools.cache
def brgemm_attention_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether :func:`paged_attention` can run rows as GEMMs through brgemm (``brgemm`` other than ``NEVER``):
    bfloat16, head sizes a multiple of 32 up to 256, the kernel built with AVX512-BF16, and brgemm running
    bfloat16 here (:func:`brgemm_bf16_supported`)."""
    return (
        dtype == torch.bfloat16
        and head_dim % 32 == 0
        and head_dim <= 256
        and paged_attention_available()
        and bool(torch.ops.batchgen.has_bf16_dot_product())
        and brgemm_bf16_supported()
    )


def brgemm_rows(dtype: torch.dtype, head_dim: int, batch_invariant: bool) -> BrgemmRows:
    """Which rows :func:`paged_attention` should run through brgemm for a pool of ``dtype`` and ``head_dim``:
    none where it cannot (:func:`brgemm_attention_supported`); every row where a row's results must not depend on
    the batch (``batch_invariant``); else the rows of many queries and shared prefixes, the fastest."""
    if not brgemm_attention_supported(dtype, head_dim):
        return BrgemmRows.NEVER
    return BrgemmRows.EVERY_ROW if batch_invariant else BrgemmRows.MANY_QUERIES


def has_amx() -> bool:
    """Whether this CPU has AMX tiles that PyTorch's CPU kernels use (``torch.cpu``'s own probe)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def _build_name() -> str:
    """The extension's name, hence its cache folder: a hash of everything the built library depends on (the
    sources, the flags, torch and Python versions, the ninja and compiler found on ``$PATH``, and for
    ``-march=native`` the CPU model and its instruction set flags), so that a changed source, an upgraded torch
    or another machine sharing the cache never loads a library built for something else."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = "\n".join([line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2])
    except OSError:
        cpu = platform.processor() or platform.machine()
    # Two ninja builds disagree on which outputs are stale (seen: pip's ninja 1.13 and the system's 1.11 rebuilt
    # the library in turn, each time the other had run), so each toolchain gets its own folder.
    tools = [str(shutil.which(tool)) for tool in ("ninja", "c++")]
    # The sources' folder too: torch's build file names them by absolute path, so two checkouts sharing one cache
    # folder would rewrite it in turn and each rebuild the library.
    folder = str(Path(__file__).resolve().parent)
    parts = [
        *(f.read_text() for f in _SOURCES + _HEADERS),
        " ".join(_CFLAGS),
        torch.__version__,
        sys.version,
        cpu,
        folder,
    ]
    parts += tools
    return "batchgen_cpu_kernels_" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _build_error_line(error: BaseException) -> str:
    """The line of a build failure worth showing: torch raises the whole ninja log (progress, compile commands,
    compiler output); keep the compiler's first error, else the first other message (``c++: not found``)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    noise = ("[", "FAILED:", "ninja:", "Error building extension")
    useful = [line for line in lines if not line.startswith(noise) and " -o " not in line]
    errors = [line for line in useful if "error" in line.lower()]
    detail = (errors or useful or lines or [type(error).__name__])[0]
    return detail if len(detail) <= 300 else detail[:297] + "..."


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``build_dir/batchgen.lock`` around torch's build-and-load.

    torch serialises builds with a plain ``lock`` file that its builder deletes when done; a process killed while
    holding it (SIGKILL, or SIGTERM before batchgen's handlers are installed) leaves it behind, and every later
    load then waits for it forever. An ``flock`` dies with its process, so whoever holds this one is the only
    batchgen building or loading here: a ``lock`` file found then is such a leftover, and is removed.
    """
    with open(build_dir / "batchgen.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def build_problem() -> str | None:
    """Build and load the extension (once per process); ``None`` when it works, else why not, in one line.

    A failure is also reported once on stderr, with the fallback batchgen takes.
    """
    from torch.utils import cpp_extension

    # torch logs its own multi-line warnings while building (e.g. about an unexpected compiler); the one line
    # below says what matters.
    torch_log = logging.getLogger(cpp_extension.__name__)
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    name = _build_name()
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    if not (build_dir / f"{name}.so").exists():
        # Otherwise the first run sits silent for the whole compile.
        print("batchgen: building the CPU kernels for this machine (once; 15-40 s on two idle cores)", file=sys.stderr)
    try:
        with warnings.catch_warnings(), _build_lock(build_dir):
            started = time.monotonic()  # after the lock: time waiting for another process's build is not ours
            warnings.simplefilter("ignore")
            cpp_extension.load(
                name=name,
                sources=[str(f) for f in _SOURCES],
                extra_cflags=_CFLAGS,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
    except Exception as e:  # compiler or ninja missing, compile errors (RuntimeError with the whole log), dlopen
        problem = f"the CPU kernels did not build ({_build_error_line(e)})"
        print(
            f"batchgen: {problem}; using the slower PyTorch code (BATCHGEN_CPU_ATTENTION_KERNEL=0, "
            "BATCHGEN_CPU_FUSED_OPS=0 and BATCHGEN_CPU_HALF_WEIGHT_LINEAR=0 hide this)",
            file=sys.stderr,
        )
        return problem
    finally:
        torch_log.setLevel(level)
    seconds = time.monotonic() - started
    if seconds > 2:  # a compile, not a cache hit
        print(f"batchgen: built the CPU kernels in {seconds:.0f} s (cached for later runs)", file=sys.stderr)
    return None


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    brgemm: BrgemmRows = BrgemmRows.NEVER,
) -> torch.Tensor:
    """Causal attention of each row's new tokens over its whole sequence, read in place from the paged pool.

    Row ``r`` (``n`` rows) is request row ``req_pool_indices[r]`` of ``req_to_token``, ``seq_lens[r]`` tokens
    long, whose last ``q_lens[r]`` tokens are new: they are ``q[q_starts[r] : q_starts[r] + q_lens[r]]``. New
    token ``t`` sits at position ``p = seq_lens[r] - q_lens[r] + t`` and attends to positions ``0..p``, whose
    K/V are at slots ``req_to_token[req_pool_indices[r], 0..p]``; query head ``h`` uses KV head
    ``h // (num_heads // num_kv_heads)`` (GQA). Per query: ``softmax(scale * q·K^T) V`` (Vaswani et al. 2017),
    computed with an online softmax (Milakov & Gimelshein 2018) that accumulates in float32; in bfloat16 and
    float16 the probabilities are rounded to that dtype before weighting V, as PyTorch's SDPA (which HF
    transformers runs) and FlashAttention do, so greedy tokens follow HF's. The output is cast to q's dtype.
    On the vector path (and with ``brgemm=EVERY_ROW``) a query's result does not depend on the other rows, on its
    row's ``q_lens`` or on threading (it is bit-identical in any batch). ``brgemm`` (where
    :func:`brgemm_attention_supported`) sends rows to two GEMMs per block of 256 keys through PyTorch's
    ``at::native::cpublas::brgemm`` (AMX tiles, or ``vdpbf16ps``) instead: which rows, and what that does to their
    bits, :class:`BrgemmRows` says.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``, float32, bfloat16 or float16, head_dim contiguous.
        k_cache, v_cache: one layer of the pool, ``[num_kv_heads, num_slots, head_dim]``, q's dtype.
        req_to_token: int64 ``[max_reqs, context_len]``, rows contiguous.
        req_pool_indices, seq_lens, q_starts, q_lens: int64 ``[n]``.
        scale: the score scale, usually ``head_dim ** -0.5``.
        out: ``[num_tokens, num_heads, head_dim]`` in q's dtype to write into (head_dim contiguous); only the
            rows' tokens are written, the others keep their values. ``None``: a new, uninitialised tensor.
        brgemm: which rows run through brgemm; other than ``NEVER`` only where :func:`brgemm_attention_supported`.

    Returns:
        ``out``.

    Raises:
        RuntimeError: with a ``batchgen::paged_attention:`` message for tensors not on the CPU, mismatched
            shapes or dtypes, indices outside their tensors (including slots outside the pool), or ``brgemm``
            where it cannot run; or when the extension is not available (check :func:`paged_attention_available`
            first).
    """
    problem = build_problem()
    if problem is not None:
        raise RuntimeError(problem)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    torch.ops.batchgen.paged_attention(
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, q_starts, q_lens, scale, out, int(brgemm)
    )
    return out
