"""Attention backends, chosen by name (``--attention-backend``)."""

from __future__ import annotations

import torch

from batchgen.errors import BatchgenError
from batchgen.kernels.attention.base import AttentionBackend
from batchgen.kernels.attention.torch_native import TorchNativeAttnBackend

ATTENTION_BACKENDS = ("auto", "torch_native")


def create_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called ``name``; ``auto`` picks the fastest one available on ``device``.

    Raises:
        BatchgenError: for an unknown name.
    """
    if name in ("auto", "torch_native"):
        return TorchNativeAttnBackend()
    raise BatchgenError(f"unknown attention backend '{name}'; choose one of {', '.join(ATTENTION_BACKENDS)}")
