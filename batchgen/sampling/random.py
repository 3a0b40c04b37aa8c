"""Counter-based random numbers: noise that is a pure function of (seed, output position, stream, token id).

A request's noise at output position ``step`` depends on nothing else, so a seeded request samples the same
tokens alone or in any batch, in any order, after preemption and recompute.
"""

from __future__ import annotations

import hashlib

import torch

from batchgen.kernels.cpu.sampling_ops import exponential_race_kernel, kernel_takes

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: consecutive token ids land far apart before hashing


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' "lowbias32" integer hash on int64 tensors holding 32-bit values.

    int64 products wrap modulo 2**64, so masking keeps exactly the low 32 bits a uint32 multiply would.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


# Streams: independent noise for the same (seed, step). Plain draws (and draft-model drafts) use DRAW;
# rejection sampling of a draft tests it with ACCEPT and redraws a rejected one with RESIDUAL.
DRAW, ACCEPT, RESIDUAL = 0, 1, 2


def _row_hash(seeds: torch.Tensor, steps: torch.Tensor, stream: int) -> torch.Tensor:
    """int64 ``[n]`` 32-bit hashes of (seed, step, stream), the root of all of a row's noise at that step."""
    # The odd constants keep the chain off the hash's fixed point: lowbias32(0) = 0, so without them seed 0 at
    # step 0 drew u ≈ 0 (the first token with any probability, found by a new user).
    h = _mix32((seeds & _MASK32) ^ 0x85EBCA6B)
    h = _mix32(h ^ ((seeds >> 32) & _MASK32) ^ 0xC2B2AE35)
    h = _mix32(h ^ (steps & _MASK32) ^ 0x27D4EB2F)
    if stream != DRAW:
        h = _mix32(h ^ ((stream * 0x632BE5AB) & _MASK32))
    return h


def uniform_from_counter(seeds: torch.Tensor, steps: torch.Tensor, stream: int = DRAW) -> torch.Tensor:
    """float64 ``[n]`` uniforms in the open interval (0, 1), a pure function of int64 ``seeds`` and ``steps``
    and of ``stream`` (a small int: :data:`DRAW`, :data:`ACCEPT`, :data:`RESIDUAL`)."""
    h = _row_hash(seeds, steps, stream)
    low = _mix32(h ^ _GOLDEN)
    bits = (h << 21) | (low >> 11)  # 53 random bits, the precision of a float64 mantissa
    return (bits.double() + 0.5) / float(1 << 53)


def token_noise_keys(seeds: torch.Tensor, steps: torch.Tensor, stream: int = DRAW) -> torch.Tensor:
    """int64 ``[n, 2]``: the two 32-bit keys from which :func:`exponential_noise` derives every token's noise of
    row ``i`` (a pure function of ``seeds[i]``, ``steps[i]`` and ``stream``; the CPU kernel takes them too)."""
    h = _row_hash(seeds, steps, stream)
    return torch.stack([_mix32(h ^ 0x165667B1), _mix32(h ^ 0xD3A2646C)], dim=1)


def exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float64 ``[n, vocab_size]`` standard exponentials ``E = −log(1 − w)``, one per (row key, token id).

    ``w = (x + 0.5) / 2**32`` with ``x`` the 32-bit hash ``mix(mix(id · φ + key_a) ^ key_b)``; ``log1p`` keeps
    small ``E``, which decide the exponential race, exact to float64 precision.
    """
    ids = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    x = _mix32(_mix32((ids[None, :] * _GOLDEN + keys[:, :1]) & _MASK32) ^ keys[:, 1:])
    w = (x.double() + 0.5) / float(1 << 32)
    return -torch.log1p(-w)


def exponential_race(weights: torch.Tensor, keys: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
    """int64 ``[rows]``: each row's ``argmax_i weights[i] / E_i``, ``E`` the row's :func:`exponential_noise` of
    ``keys``; first index on ties.

    With ``weights`` ``[rows, vocab]`` unnormalised probabilities (float32, ≥ 0, zero for excluded tokens) the
    winner follows ``weights / weights.sum()`` exactly: the minimum of independent exponentials ``E_i / w_i`` is
    attained at ``i`` with probability ``w_i / Σ w`` (the exponential race; equivalently Gumbel-max,
    ``argmax log w_i − log E_i``). A row with no positive weight gets ``torch.argmax(weights)``. ``keys``: int64
    ``[rows, 2]`` from :func:`token_noise_keys`. Runs the C++ op where ``use_kernel`` and
    :func:`batchgen.kernels.cpu.sampling_ops.kernel_takes` allow.
    """
    if kernel_takes(weights, use_kernel):
        return exponential_race_kernel(weights, keys)
    positive = weights > 0
    scores = torch.where(positive, weights.double() / exponential_noise(keys, weights.shape[1]), 0.0)
    return torch.where(positive.any(dim=1), scores.argmax(dim=1), weights.argmax(dim=1))


def derive_seed(base: int, key: str | int) -> int:
    """A 63-bit seed, a pure function of ``base`` and ``key`` (BLAKE2b of ``"base:key"``).

    Gives a row without a seed one from (run seed, row id), and sample ``i`` of an ``n > 1`` row one from (row
    seed, i), so neither depends on batch composition or on the other rows of the job.
    """
    digest = hashlib.blake2b(f"{base}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
