"""Linear layers with oneDNN-prepacked weights, for the CPU.

float32 models pack their weights as they are: PyTorch's ``F.linear`` in float32 runs MKL, which takes a slower
code path on AMD CPUs than oneDNN's packed GEMM (docs/performance.md); an output then differs from ``F.linear``'s
in its last float32 bits, by the order of the sums. For bfloat16 and float16 models, two cases, chosen per machine
by :func:`cpu_gemm_dtype`:

- **oneDNN runs the model's dtype on the CPU's own units** (bfloat16 with AVX512-BF16 or AMX, float16 with
  AVX512-FP16, AMX-FP16 or AVX-NE-CONVERT): a ``F.linear`` there reorders the weight into oneDNN's blocked
  layout on every call, a large part of a decode step's short GEMMs. Packing each weight once at load time
  (``torch.ops.mkldnn._reorder_linear_weight``, what Inductor's CPU weight prepacking uses) and calling
  ``torch.ops.mkldnn._linear_pointwise`` on it gives the same kernel the same inputs: outputs are bit-identical
  to ``F.linear`` (tests/kernels/test_packed_linear.py).
- **It does not**: bfloat16 or float16 on a CPU with AVX2 but no AVX-512 (AMD Zen 2/3, Intel's client parts of
  the last years), where PyTorch's ``F.linear`` in those dtypes falls back to generic loops; bfloat16 on AVX-512
  without BF16 (Skylake to Ice Lake Xeons, and VMs whose hypervisor hides the newer units), where oneDNN converts
  it to float32 inside its GEMM. Either runs several times slower than the float32 GEMM on the same cores
  (docs/performance.md, machines B and F). The GEMMs then run in float32 on the model's own weights, kept in its
  dtype and widened as they are read (:mod:`batchgen.kernels.cpu.half_linear`, ``half_weight``): exact products,
  float32 sums, one rounding at the end, the arithmetic of a bfloat16 GEMM that accumulates in float32 as oneDNN's
  and PyTorch's own do; only the order of the sums differs, so an output can differ from ``F.linear``'s by one
  step of the model's dtype where its float32 sum lies next to a rounding boundary. Where that kernel cannot run
  (switched off, not built, :func:`~batchgen.kernels.cpu.half_linear.routes_agree` false) the weights are packed
  as float32 copies for oneDNN instead, twice the model dtype's bytes, and every input is widened to float32.

A row's output depends on that row only on the half-weight kernel and on brgemm. oneDNN's packed GEMMs serve
every row count with one weight, but not with one reduction order: which kernel and blocking oneDNN picks depends
on the row count, so a row's output can change in its last bits with the rows beside it. Measured on an AMX CPU
(tests/kernels/test_packed_linear.py checks it on each machine the suite runs on): float32 GEMMs give a row the
same bits for every row count from 2 up (one row alone may take another kernel: ``min_rows = 2`` pads it);
bfloat16 ones change with the row count in no simple pattern (33-130 rows of 576 inputs, for one), but never with
a row's place among a fixed number of rows. So ``deterministic`` runs bfloat16 layers on
:mod:`batchgen.kernels.cpu.brgemm_linear` (one summation order per output whatever the rows) where brgemm has
bfloat16 (AMX or AVX512-BF16); other layers whose GEMMs run in the model's half-precision dtype take ``call_rows``
rows a oneDNN call, the last call padded with zero rows; those on oneDNN in float32 pad a lone row to two.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from batchgen.kernels.cpu import brgemm_bf16_supported
from batchgen.kernels.cpu.brgemm_linear import COLUMN_BLOCK, brgemm_linear, brgemm_linear_silu_and_mul, pack_for_brgemm
from batchgen.kernels.cpu.half_linear import half_weight_linear, pack_half_weight, routes_agree

_ROWS_HINT = 64  # oneDNN picks its blocking for this many rows; any row count runs on the packed weight
# Rows per oneDNN call of a half-precision GEMM under --deterministic where brgemm does not run it (float16 models,
# odd widths): a decode round of up to 64 rows is one call; larger ones take a call per 64
# rows, each reading the weights again.
DETERMINISTIC_CALL_ROWS = 64


def native_gemm_supported(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN runs GEMMs in ``dtype`` on units made for it, as PyTorch reports them: float32
    always; bfloat16 with AVX512-BF16 or AMX (oneDNN also takes bfloat16 on other AVX-512 parts, converting it to
    float32 inside the GEMM: slower than packing the weights as float32, so not counted); float16 with AVX512-FP16,
    AMX-FP16 or AVX-NE-CONVERT."""
    if dtype == torch.bfloat16:
        units = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and units
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


def cpu_gemm_dtype(
    dtype: torch.dtype, device: torch.device, prepack: bool = True, deterministic: bool = False
) -> torch.dtype | None:
    """The dtype in which a ``dtype`` model's linear layers run packed on ``device``, or ``None`` for plain
    ``F.linear``.

    ``dtype`` itself where oneDNN runs it on units made for it (:func:`native_gemm_supported`; float32 always),
    float32 for a bfloat16 or float16 model elsewhere; ``None`` off the CPU, without oneDNN, or without
    ``prepack`` (``KernelSwitches.cpu_prepack``, ``$BATCHGEN_CPU_PREPACK``: then MKL's ``F.linear``) unless
    ``deterministic``.
    """
    if device.type != "cpu" or not torch.backends.mkldnn.is_available() or not (prepack or deterministic):
        return None
    if dtype == torch.float32:
        return dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    return dtype if native_gemm_supported(dtype) else torch.float32


def half_weight_runs(dtype: torch.dtype, gemm_dtype: torch.dtype | None, enabled: bool) -> bool:
    """Whether the linear layers of a ``dtype`` model packed for ``gemm_dtype`` GEMMs run on their own
    half-precision weights (:class:`PackedLinear`'s ``half_weight``): a bfloat16 or float16 model whose GEMMs run in
    float32, where ``enabled`` (``KernelSwitches.cpu_half_weight_linear``) and the kernel builds with its two routes
    agreeing (:func:`~batchgen.kernels.cpu.half_linear.routes_agree`)."""
    return enabled and gemm_dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16) and routes_agree()


class PackedLinear(nn.Module):
    """``y = x W^T + b`` over ``W`` packed once, for oneDNN, for brgemm under ``deterministic``, or for the
    half-weight kernel, computed in ``gemm_dtype``.

    Args:
        weight: ``[out_features, in_features]`` on the CPU, in the model's dtype (copied into the packed layout).
        bias: ``[out_features]`` in the model's dtype, or ``None``.
        gemm_dtype: the dtype the GEMM runs in: the weight's own, or float32 (see the module docstring);
            default the weight's.
        half_weight: with a float32 ``gemm_dtype`` and a bfloat16 or float16 weight, every call runs
            :func:`batchgen.kernels.cpu.half_linear.half_weight_linear` on the weight packed in its own dtype
            (:func:`~batchgen.kernels.cpu.half_linear.pack_half_weight`), no float32 copy kept; ``x`` must then be
            float32 or the weight's dtype. Its rows are independent of each other as they stand.
        deterministic: a row's output depends on that row only, whatever the rows beside it (see the module
            docstring).

    ``forward(x [T, in_features]) → [T, out_features]`` in the weight's dtype; in float32, unrounded, where
    ``round_output`` is set False (the float32 carrier of :meth:`batchgen.models.llama.LlamaForCausalLM.carry_float32`,
    whose next op rounds it to the weight's dtype as it loads it). ``min_rows``: fewer rows are padded with zeros
    to that many; ``call_rows``: when set, every GEMM call gets exactly that many rows (see the module docstring).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gemm_dtype: torch.dtype | None = None,
        half_weight: bool = False,
        deterministic: bool = False,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.out_dtype = weight.dtype
        self.gemm_dtype = gemm_dtype or weight.dtype
        self.round_output = True
        self.min_rows = 1
        self.call_rows = 0
        self.half_weight: torch.Tensor | None = None
        self.brgemm_weight: torch.Tensor | None = None
        if half_weight:
            assert self.gemm_dtype == torch.float32 and weight.dtype in (torch.bfloat16, torch.float16)
            self.half_weight = pack_half_weight(weight)
            self.bias = None if bias is None else bias.detach().float()
            return
        if deterministic and self._brgemm_runs(weight):
            self.brgemm_weight = pack_for_brgemm(weight.detach().to(torch.bfloat16))
            self.bias = None if bias is None else bias.detach().float()
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(self.gemm_dtype), _ROWS_HINT)
        self.bias = None if bias is None else bias.detach().to(self.gemm_dtype)
        if deterministic and self.gemm_dtype == torch.float32:
            self.min_rows = 2
        elif deterministic:
            self.call_rows = DETERMINISTIC_CALL_ROWS

    def _brgemm_runs(self, weight: torch.Tensor) -> bool:
        """Whether this layer's batch-invariant GEMM is :mod:`batchgen.kernels.cpu.brgemm_linear`'s."""
        return self.gemm_dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and brgemm_bf16_supported()

    def fuses_silu_and_mul(self) -> bool:
        """Whether :meth:`silu_and_mul` runs: a bfloat16 gate/up projection on brgemm, without bias, whose halves
        are whole blocks of :data:`~batchgen.kernels.cpu.brgemm_linear.COLUMN_BLOCK` columns."""
        return (
            self.brgemm_weight is not None
            and self.bias is None
            and self.round_output
            and self.out_dtype == torch.bfloat16
            and self.out_features % (2 * COLUMN_BLOCK) == 0
        )

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """This layer as a SwiGLU gate/up projection (gate rows, then up rows) with its activation:
        ``x`` ``[T, in_features]`` → ``bf16(bf16(silu(gate)) * up)`` ``[T, out_features / 2]`` bfloat16, the bits of
        ``forward`` then :func:`batchgen.kernels.cpu.fused_elementwise.silu_and_mul`
        (:func:`~batchgen.kernels.cpu.brgemm_linear.brgemm_linear_silu_and_mul`). Only where
        :meth:`fuses_silu_and_mul`."""
        assert self.brgemm_weight is not None and self.fuses_silu_and_mul()
        x = x.to(torch.bfloat16).contiguous()
        return brgemm_linear_silu_and_mul(x, self.brgemm_weight, self.out_features // 2)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(self.gemm_dtype), self.packed, self.bias, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.brgemm_weight is not None:
            rounded = self.round_output and self.out_dtype == torch.bfloat16
            x = x.to(torch.bfloat16).contiguous()
            out = brgemm_linear(x, self.brgemm_weight, self.out_features, self.bias, rounded)
        elif self.half_weight is not None:
            out = half_weight_linear(x.contiguous(), self.half_weight, self.out_features, self.bias)
        else:
            padded = max(self.min_rows, -(-rows // self.call_rows) * self.call_rows if self.call_rows else rows)
            if padded > rows:
                x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
            if self.call_rows and padded > self.call_rows:
                out = torch.cat([self._gemm(part) for part in x.split(self.call_rows)])[:rows]
            else:
                out = self._gemm(x)[:rows]
        return out.to(self.out_dtype) if self.round_output else out


def replace_linears(module: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every ``nn.Linear`` under ``module`` by ``make(linear)``; return how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
            count += 1
        else:
            count += replace_linears(child, make)
    return count


def prepack_linears(
    module: nn.Module, gemm_dtype: torch.dtype | None = None, deterministic: bool = False, half_weight: bool = False
) -> int:
    """Replace every ``nn.Linear`` under ``module`` by a :class:`PackedLinear` of its weights computing in
    ``gemm_dtype`` (default: each weight's own dtype), batch invariant with ``deterministic``, running every call
    on the half-precision weights with ``half_weight`` (:class:`PackedLinear`); return how many."""
    return replace_linears(
        module, lambda linear: PackedLinear(linear.weight, linear.bias, gemm_dtype, half_weight, deterministic)
    )
