"""Sampling's per-row reductions over the vocabulary, by ``sampling.cpp`` on float32 CPU tensors where it built,
by torch elsewhere (other devices and dtypes, or no build)."""

from __future__ import annotations

import torch

from batchgen.kernels.cpu import paged_attention_available


def kernel_takes(x: torch.Tensor, use_kernel: bool) -> bool:
    """Whether the C++ ops run on ``x``: ``use_kernel``, built here, float32 ``[rows, vocab > 0]`` on the CPU with a
    contiguous last dimension."""
    return (
        use_kernel
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.shape[1] > 0
        and x.stride(1) == 1
        and paged_attention_available()
    )


def argmax_rows(logits: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` for ``[rows, vocab]`` logits (int64 ``[rows]``: the first index of each
    row's largest value, or of its first NaN), by the C++ op on float32 CPU logits with a contiguous last dimension
    when ``use_kernel`` (the attention kernel's switch) and the build is available; by torch elsewhere. The C++
    op takes each row's maximum 16 lanes at a time, where torch's CPU argmax compares one element at a time
    (~1 ms per decode round at 64 rows of 32k logits)."""
    if kernel_takes(logits, use_kernel):
        out: torch.Tensor = torch.ops.batchgen.argmax_rows(logits)
        return out
    return torch.argmax(logits, dim=-1)


def log_softmax_at(logits: torch.Tensor, ids: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
    """``torch.log_softmax(logits, dim=-1).gather(1, ids)``: float32 ``[rows, vocab]`` logits, int64 ``[rows, k]``
    ids → ``[rows, k]`` in the logits' dtype; by the C++ op where :func:`kernel_takes` the logits (then float32),
    which computes each row's maximum and log-sum-exp in two passes over it and never writes the
    ``[rows, vocab]`` log_softmax, by torch elsewhere. The two agree to float32 rounding (the sums' order and the
    exponential's last bits); NaN where torch gives NaN (a row with a NaN or without a finite maximum).

    Raises:
        RuntimeError: (``batchgen::log_softmax_at: ...``) ids outside ``[0, vocab)`` or of another shape.
    """
    if kernel_takes(logits, use_kernel):
        out: torch.Tensor = torch.ops.batchgen.log_softmax_at(logits, ids)
        return out
    return torch.log_softmax(logits, dim=-1).gather(1, ids)


def exponential_race_kernel(weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The C++ op of :func:`batchgen.sampling.random.exponential_race` (check :func:`kernel_takes` first): the same
    winners, computing the noise only for tokens that could still win, in float64 as the torch code does."""
    out: torch.Tensor = torch.ops.batchgen.exponential_race(weights, keys)
    return out
