"""Linear layers of a few rows on bfloat16 or float16 weights (``half_linear.cpp``), for CPUs where those dtypes'
GEMMs run in float32 (no BF16 units: AVX2 alone, or AVX-512 without BF16;
:func:`~batchgen.models.packed_linear.cpu_gemm_dtype`).

There a half-precision model's linear layers run as float32 GEMMs on float32 copies of the weights
(:mod:`batchgen.models.packed_linear`). A round of a few rows (a small batch's decode, a prefill round's sampled
rows through the LM head) is bound by reading the weights, and this kernel reads the model's own half-precision
weights, half the bytes, widening them to float32 in registers: products and sums in float32 as in the float32
GEMM, in another order, so a result can differ from it in its last float32 bits. A row's result never depends on
the other rows of the call. The more rows, the more each weight is reused and the less halving its bytes pays,
while oneDNN's float32 GEMM blocks registers better than this kernel's tiles of at most 4 rows: past some row count
it is faster (the crossover, alone and in the engine, is measured in docs/performance.md).
"""

from __future__ import annotations

import torch

from batchgen.kernels.cpu import build_problem

# Rows up to which the kernel runs a linear layer instead of the float32 GEMM, where a DECODE round of that many rows
# also runs its layers in one C++ call (batchgen.models.one_call_decode): below the crossover of the two in the
# engine on the CPUs measured (docs/performance.md: AVX2 machines, and AVX-512 without BF16, where the kernel alone
# loses to the GEMM at fewer rows but the one call's savings keep the pair ahead).
FEW_ROWS = 24


def half_weight_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` in float32: ``x`` ``[rows, in]`` float32 or the weight's dtype, ``weight`` ``[out, in]``
    bfloat16 or float16, ``bias`` ``[out]`` float32 or ``None``; returns ``[rows, out]`` float32, unrounded.

    Raises:
        RuntimeError: (``batchgen::half_weight_linear: ...``) other dtypes, shapes that disagree, tensors off the
            CPU or not contiguous; the extension's build problem when it did not build.
    """
    problem = build_problem()
    if problem is not None:
        raise RuntimeError(problem)
    out: torch.Tensor = torch.ops.batchgen.half_weight_linear(x, weight, bias)
    return out
