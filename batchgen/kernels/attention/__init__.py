"""Attention backends, chosen by name (``--attention-backend``)."""

from __future__ import annotations

import os

import torch

from batchgen.errors import BatchgenError
from batchgen.kernels.attention.base import AttentionBackend
from batchgen.kernels.attention.torch_native import TorchNativeAttnBackend

ATTENTION_BACKENDS = ("auto", "torch_native", "triton")


def create_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called ``name``; ``auto`` picks the fastest one available on ``device``.

    ``auto`` is ``triton`` on CUDA when triton imports, else ``torch_native``. ``triton`` (and only it)
    imports triton, so batchgen runs without it installed.

    Raises:
        BatchgenError: for an unknown name, or ``triton`` when it cannot run on ``device`` (see
            :func:`_create_triton`).
    """
    if name == "torch_native" or (name == "auto" and device.type != "cuda"):
        return TorchNativeAttnBackend()
    if name == "auto":
        try:
            import triton  # noqa: F401
        except ImportError:
            return TorchNativeAttnBackend()
        return _create_triton(device)
    if name == "triton":
        return _create_triton(device)
    raise BatchgenError(f"unknown attention backend '{name}'; choose one of {', '.join(ATTENTION_BACKENDS)}")


def _triton_interpret_set() -> bool:
    # The truthy spellings Triton itself accepts for boolean environment variables.
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def _create_triton(device: torch.device) -> AttentionBackend:
    """The Triton backend on ``device``.

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
    if device.type == "cpu" and not _triton_interpret_set():
        raise BatchgenError(
            "attention backend 'triton' on the CPU runs only in Triton's interpreter: set TRITON_INTERPRET=1 "
            "(slow, for testing) or use --attention-backend torch_native"
        )
    if device.type not in ("cuda", "cpu"):
        raise BatchgenError(
            f"attention backend 'triton' runs on CUDA (or the CPU under TRITON_INTERPRET=1), not {device.type}"
        )
    from batchgen.kernels.attention.triton_backend import TritonAttnBackend

    return TritonAttnBackend(device)
