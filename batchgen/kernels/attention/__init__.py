"""Attention backends, chosen by name (``--attention-backend``)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch

from batchgen.errors import BatchgenError
from batchgen.kernels.attention.base import AttentionBackend
from batchgen.kernels.attention.torch_native import TorchNativeAttnBackend
from batchgen.kernels.cpu import brgemm_bf16_supported, build_problem, has_amx, paged_attention_available
from batchgen.kernels.cpu.half_linear import routes_agree
from batchgen.kernels.switches import KernelSwitches

if TYPE_CHECKING:
    from batchgen.models.config import ModelConfig

ATTENTION_BACKENDS = ("auto", "torch_native", "triton", "flashinfer")


def create_attention_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype | None = None,
    config: ModelConfig | None = None,
    switches: KernelSwitches = KernelSwitches(),
    deterministic: bool = False,
) -> AttentionBackend:
    """The backend called ``name``; ``auto`` picks the fastest one available on ``device``.

    ``auto`` on CUDA is ``flashinfer`` when it can run the model (``dtype`` float16/bfloat16, ``config``'s head
    size supported, the package importable and its kernels built), else ``triton`` when triton imports, else
    ``torch_native``. ``flashinfer`` and ``triton`` import their packages only when chosen, so batchgen runs
    without them installed. FlashInfer plans with the model's head counts, hence ``dtype`` and ``config``;
    without them ``auto`` does not consider it. ``switches``: whether torch_native may use the CPU kernel, and
    whether Triton runs interpreted (the only way it runs on the CPU). ``deterministic``: the backend
    :func:`deterministic_backend` names, in its batch-invariant mode: torch_native with every row in the C++
    kernel, through brgemm where it runs bfloat16 and on the vector path elsewhere
    (:class:`~batchgen.kernels.cpu.BrgemmRows`), or triton decoding with its extend kernel; either way a query's
    result depends only on its row.

    Raises:
        BatchgenError: ``flashinfer`` / ``triton`` when it cannot run here (one line saying why), ``deterministic``
            with a backend it cannot use or where the CPU kernel cannot run or is switched off; an unknown
            name is :meth:`batchgen.loop.options.EngineOptions.validate`'s to report.
    """
    if deterministic:
        if deterministic_backend(name, device) == "triton":
            return _create_triton(device, switches.triton_interpret, deterministic=True)
        problem = build_problem() if switches.cpu_attention_kernel else "BATCHGEN_CPU_ATTENTION_KERNEL=0"
        if problem is not None:
            raise BatchgenError(f"--deterministic needs batchgen's CPU attention kernel ({problem})")
        return TorchNativeAttnBackend(True, deterministic=True)
    if name == "torch_native" or (name == "auto" and device.type != "cuda"):
        if device.type == "cpu" and switches.cpu_attention_kernel:
            paged_attention_available()  # build the CPU kernel now (once), not inside the first timed round
        return TorchNativeAttnBackend(switches.cpu_attention_kernel)
    if name == "flashinfer":
        return _create_flashinfer(device, dtype, config)
    if name == "auto" and dtype is not None and config is not None:
        from batchgen.kernels.attention import flashinfer_backend  # does not import flashinfer itself

        shape = (config.num_heads, config.num_kv_heads, config.head_dim)
        if flashinfer_backend.unavailable_reason(device, dtype, *shape) is None:  # else quietly the next one
            try:
                return flashinfer_backend.FlashInferAttnBackend(device, dtype, *shape)
            except BatchgenError as e:  # installed and importable, but its kernels would not build
                print(f"batchgen: {e}; using another attention backend", file=sys.stderr)
    if name == "auto":
        try:
            import triton  # noqa: F401
        except ImportError:
            return TorchNativeAttnBackend(switches.cpu_attention_kernel)
        return _create_triton(device, switches.triton_interpret)
    assert name == "triton", f"unknown attention backend {name!r}"
    return _create_triton(device, switches.triton_interpret)


def deterministic_backend(name: str, device: torch.device) -> str:
    """The attention backend ``--deterministic`` runs for ``--attention-backend name`` on ``device``: ``auto`` is
    torch_native (batchgen's C++ kernel) on the CPU and triton on CUDA; triton on the CPU runs in Triton's
    interpreter (``TRITON_INTERPRET=1``), the GPU path's test. Triton's path also runs the linear layers on its
    batch-invariant GEMM (:meth:`batchgen.models.source.ModelSource.load`).

    Raises:
        BatchgenError: flashinfer (its decode and prefill kernels tile a query's keys differently, so a token's
            bits would depend on the round that computes it), or torch_native off the CPU (torch's attention).
    """
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch_native"
    if name == "flashinfer":
        raise BatchgenError(
            "--deterministic does not run on attention backend flashinfer (its decode and prefill kernels tile a "
            "query's keys differently); use --attention-backend triton"
        )
    if name == "torch_native" and device.type != "cpu":
        raise BatchgenError(f"--deterministic on {device.type} needs --attention-backend triton, not torch_native")
    return name


def deterministic_by_default(name: str, device: torch.device, switches: KernelSwitches) -> bool:
    """Whether ``--deterministic`` holds when neither it nor ``--no-deterministic`` is given: where the
    batch-invariant run was measured to cost nothing beyond the runs' spread (docs/performance.md). That is the
    CPU kernel's path (``name`` auto or torch_native, the kernel switched on) on a CPU without AMX: with
    AVX512-BF16, where brgemm runs bfloat16 and a bfloat16 model's linear layers and attention run through it
    either way; without it, on AVX-512 or on AVX2 with the kernel's 8-lane block step, where a bfloat16 model's
    linear layers run on the half-weight kernel (batch invariant as it stands; its switch on and its routes
    agreeing) and its prefill rows in the attention kernel either way
    (:func:`~batchgen.kernels.cpu.prefill_rows_supported`), so the mode changes no arithmetic for it (a float32 or
    float16 model's prefill rows move from SDPA to the kernel, and a float32 GEMM pads a lone row to two: measured
    level in float32; on AVX2 so do a bfloat16 model's whose head size is not a multiple of 8, onto the kernel's
    generic step, a case no model measured here has). Elsewhere the mode costs more or was not measured since its
    last change: AMX; CPUs without AVX2; GPUs. AVX2 was measured on an AMD Zen 1 only; other AVX2 CPUs follow it."""
    if device.type != "cpu" or name not in ("auto", "torch_native") or not switches.cpu_attention_kernel:
        return False
    if has_amx():
        return False
    if brgemm_bf16_supported():
        return True
    if torch.cpu._is_avx512_bf16_supported() or build_problem() is not None:
        return False
    vector_step = torch.cpu._is_avx512_supported() or torch.ops.batchgen.has_avx2_block()
    return bool(vector_step) and switches.cpu_half_weight_linear and routes_agree()


def _create_flashinfer(device: torch.device, dtype: torch.dtype | None, config: ModelConfig | None) -> AttentionBackend:
    """The FlashInfer backend for ``config``'s attention shape in ``dtype``.

    Raises:
        BatchgenError: not CUDA, float32, an unsupported head size, flashinfer not importable or its kernels
            not buildable (the message says which, in one line).
    """
    from batchgen.kernels.attention import flashinfer_backend  # does not import flashinfer itself

    if dtype is None or config is None:
        raise BatchgenError("attention backend 'flashinfer' needs the model's dtype and attention shape")
    shape = (config.num_heads, config.num_kv_heads, config.head_dim)
    reason = flashinfer_backend.unavailable_reason(device, dtype, *shape)
    if reason is not None:
        raise BatchgenError(reason)
    return flashinfer_backend.FlashInferAttnBackend(device, dtype, *shape)


def _create_triton(device: torch.device, interpreted: bool, deterministic: bool = False) -> AttentionBackend:
    """The Triton backend on ``device``; ``interpreted``: Triton's interpreter runs the kernels (``TRITON_INTERPRET``);
    ``deterministic``: its batch-invariant mode.

    Raises:
        BatchgenError: when triton is not importable, when ``device`` is neither CUDA nor CPU, or when it is
            the CPU and ``TRITON_INTERPRET=1`` is not set (Triton compiles for GPUs; on the CPU only its
            interpreter runs kernels).
    """
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise BatchgenError(
            f"attention backend 'triton' needs the triton package, which cannot be imported ({e}); "
            "install it (pip install triton) or use --attention-backend torch_native"
        ) from e
    if device.type == "cpu" and not interpreted:
        raise BatchgenError(
            "attention backend 'triton' on the CPU runs only in Triton's interpreter: set TRITON_INTERPRET=1 "
            "(slow, for testing) or use --attention-backend torch_native"
        )
    if device.type not in ("cuda", "cpu"):
        raise BatchgenError(
            f"attention backend 'triton' runs on CUDA (or the CPU under TRITON_INTERPRET=1), not {device.type}"
        )
    from batchgen.kernels.attention.triton_backend import TritonAttnBackend

    return TritonAttnBackend(device, deterministic=deterministic)
