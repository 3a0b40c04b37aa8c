"""Short probes of the machine's ceilings: matmul FLOP/s and memory copy bandwidth, in the run's dtype."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from batchgen.loop.engine import dtype_name
from batchgen.models.packed_linear import PackedLinear, cpu_gemm_dtype


@dataclass(frozen=True)
class Ceilings:
    """Measured peaks: ``matmul_flops`` in FLOP/s, ``copy_bandwidth`` in bytes/s (read + write).

    ``gemm_dtype`` is the dtype the matmul ran in: the run's own, or float32 for a bfloat16/float16 run on a CPU
    whose oneDNN has no kernels for it (see :mod:`batchgen.models.packed_linear`), as the model's layers do.
    """

    matmul_flops: float
    copy_bandwidth: float
    gemm_dtype: torch.dtype

    def highest(self, other: Ceilings) -> Ceilings:
        """Each ceiling the higher of this probe's and ``other``'s: a ceiling is the best the machine showed."""
        return Ceilings(
            max(self.matmul_flops, other.matmul_flops), max(self.copy_bandwidth, other.copy_bandwidth), self.gemm_dtype
        )

    def line(self, dtype: torch.dtype) -> str:
        """``bfloat16 matmul 0.412 TFLOP/s, copy 23.8 GB/s`` for a run in ``dtype``, saying so when its GEMMs ran
        in another."""
        line = f"{dtype_name(dtype)} matmul {self.matmul_flops / 1e12:.3f} TFLOP/s"
        if self.gemm_dtype != dtype:
            line += f" (as {dtype_name(self.gemm_dtype)} GEMMs, as the model's layers run here)"
        return f"{line}, copy {self.copy_bandwidth / 1e9:.1f} GB/s"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def model_linear(
    dtype: torch.dtype, device: torch.device, n: int, prepack: bool = True
) -> tuple[Callable[[], torch.Tensor], torch.dtype]:
    """An ``[n, n] x [n, n]^T`` product of random ``dtype`` matrices run as the model's linear layers run it (a
    :class:`PackedLinear` where :func:`cpu_gemm_dtype` packs with ``prepack``, else ``F.linear``), and the dtype
    it computes in."""
    weight = torch.randn(n, n, device=device).to(dtype)
    x = torch.randn(n, n, device=device).to(dtype)
    gemm_dtype = cpu_gemm_dtype(dtype, device, prepack)
    if gemm_dtype is None:
        return (lambda: F.linear(x, weight)), dtype
    layer = PackedLinear(weight, None, gemm_dtype)
    return (lambda: layer(x)), gemm_dtype


def measure_ceilings(dtype: torch.dtype, device: torch.device, prepack: bool = True) -> Ceilings:
    """One large square matmul (n = 2048 on CPU, 8192 on GPU) through the model's linear-layer path
    (:func:`model_linear`, ``prepack`` as the engine's ``KernelSwitches.cpu_prepack``) and one large copy
    (256 MiB on CPU, 2 GiB on GPU), each the best of a few runs after a warm-up."""
    n = 8192 if device.type == "cuda" else 2048
    matmul, gemm_dtype = model_linear(dtype, device, n, prepack)
    matmul()
    matmul_time = _best_time(matmul, device, repeats=3)
    size = (2 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_time = _best_time(lambda: dst.copy_(src), device, repeats=5)
    return Ceilings(matmul_flops=2 * n**3 / matmul_time, copy_bandwidth=2 * size / copy_time, gemm_dtype=gemm_dtype)
