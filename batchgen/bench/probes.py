"""Short probes of the machine's ceilings: matmul FLOP/s and memory copy bandwidth, in the run's dtype."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ceilings:
    """Measured peaks: ``matmul_flops`` in FLOP/s, ``copy_bandwidth`` in bytes/s (read + write)."""

    matmul_flops: float
    copy_bandwidth: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn: object, device: torch.device, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_ceilings(dtype: torch.dtype, device: torch.device) -> Ceilings:
    """One large square matmul (n = 2048 on CPU, 8192 on GPU) and one large copy (256 MiB on CPU, 2 GiB on GPU),
    each the best of a few runs after a warm-up."""
    n = 8192 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.matmul(a, b)
    matmul_time = _best_time(lambda: torch.matmul(a, b), device, repeats=3)
    size = (2 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_time = _best_time(lambda: dst.copy_(src), device, repeats=5)
    return Ceilings(matmul_flops=2 * n**3 / matmul_time, copy_bandwidth=2 * size / copy_time)
