"""Sampling's per-row reductions over the vocabulary, by ``sampling.cpp`` on float32 CPU tensors where it built,
by torch elsewhere (other devices and dtypes, or no build)."""

from __future__ import annotations

import torch

from batchgen.kernels.cpu import paged_attention_available
from batchgen.sampling.random import exponential_noise


def _kernel_takes(x: torch.Tensor, use_kernel: bool) -> bool:
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
    if _kernel_takes(logits, use_kernel):
        out: torch.Tensor = torch.ops.batchgen.argmax_rows(logits)
        return out
    return torch.argmax(logits, dim=-1)


def exponential_race(weights: torch.Tensor, keys: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
    """int64 ``[rows]``: each row's ``argmax_i weights[i] / E_i``, ``E`` the row's exponential noise
    (:func:`batchgen.sampling.random.exponential_noise` of ``keys``); first index on ties.

    With ``weights`` ``[rows, vocab]`` unnormalised probabilities (float32, ≥ 0, zero for excluded tokens) the
    winner follows ``weights / weights.sum()`` exactly: the minimum of independent exponentials ``E_i / w_i`` is
    attained at ``i`` with probability ``w_i / Σ w`` (the exponential race; equivalently Gumbel-max,
    ``argmax log w_i − log E_i``). A row with no positive weight gets ``torch.argmax(weights)``. ``keys``: int64
    ``[rows, 2]`` from :func:`batchgen.sampling.random.token_noise_keys`. The C++ op (where ``use_kernel`` and the
    build allow) computes the noise only for tokens that could still win, in float64 as the torch code does.
    """
    if _kernel_takes(weights, use_kernel):
        out: torch.Tensor = torch.ops.batchgen.exponential_race(weights, keys)
        return out
    positive = weights > 0
    scores = torch.where(positive, weights.double() / exponential_noise(keys, weights.shape[1]), 0.0)
    return torch.where(positive.any(dim=1), scores.argmax(dim=1), weights.argmax(dim=1))
