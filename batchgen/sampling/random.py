"""Counter-based random numbers: one uniform per (seed, step), independent of batch composition.

A request's noise at output position ``step`` depends on nothing else, so a seeded request samples the same
tokens alone or in any batch, in any order, after preemption and recompute.
"""

from __future__ import annotations

import hashlib

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' "lowbias32" integer hash on int64 tensors holding 32-bit values.

    int64 products wrap modulo 2**64, so masking keeps exactly the low 32 bits a uint32 multiply would.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


# Streams: independent uniforms for the same (seed, step). Plain draws (and draft-model drafts) use DRAW;
# rejection sampling of a draft tests it with ACCEPT and redraws a rejected one with RESIDUAL.
DRAW, ACCEPT, RESIDUAL = 0, 1, 2


def uniform_from_counter(seeds: torch.Tensor, steps: torch.Tensor, stream: int = DRAW) -> torch.Tensor:
    """float64 ``[n]`` uniforms in the open interval (0, 1), a pure function of int64 ``seeds`` and ``steps``
    and of ``stream`` (a small int: :data:`DRAW`, :data:`ACCEPT`, :data:`RESIDUAL`)."""
    # The odd constants keep the chain off the hash's fixed point: lowbias32(0) = 0, so without them seed 0 at
    # step 0 drew u ≈ 0 (the first token with any probability, found by a new user).
    h = _mix32((seeds & _MASK32) ^ 0x85EBCA6B)
    h = _mix32(h ^ ((seeds >> 32) & _MASK32) ^ 0xC2B2AE35)
    h = _mix32(h ^ (steps & _MASK32) ^ 0x27D4EB2F)
    if stream != DRAW:  # DRAW keeps the chain it always had, so seeded outputs do not change
        h = _mix32(h ^ ((stream * 0x632BE5AB) & _MASK32))
    low = _mix32(h ^ 0x9E3779B9)
    bits = (h << 21) | (low >> 11)  # 53 random bits, the precision of a float64 mantissa
    return (bits.double() + 0.5) / float(1 << 53)


def derive_seed(base: int, key: str | int) -> int:
    """A 63-bit seed, a pure function of ``base`` and ``key`` (BLAKE2b of ``"base:key"``).

    Gives a row without a seed one from (run seed, row id), and sample ``i`` of an ``n > 1`` row one from (row
    seed, i), so neither depends on batch composition or on the other rows of the job.
    """
    digest = hashlib.blake2b(f"{base}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
