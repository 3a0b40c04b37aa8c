"""Whether FlashInfer can run here: the dtypes and head sizes its kernels take, and whether it imports.

Imports neither flashinfer nor CUDA until asked (``import_problem``), so ``auto`` can ask cheaply.
"""

from __future__ import annotations

import functools

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)  # FlashInfer's JIT has no float32 attention kernels
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # the head sizes FlashInfer's FA2 kernels are built and tested for


def config_problem(dtype: torch.dtype, num_qo_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
    """Why FlashInfer cannot run a model of this dtype and shape, or ``None`` when it can."""
    if dtype not in SUPPORTED_DTYPES:
        name = str(dtype).removeprefix("torch.")
        return (
            f"--attention-backend flashinfer runs float16 and bfloat16 models only, not {name}; "
            "use --dtype bfloat16 or --attention-backend triton"
        )
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"--attention-backend flashinfer supports head_dim 64, 128 or 256; this model's is {head_dim}"
    if num_kv_heads <= 0 or num_qo_heads % num_kv_heads:
        return f"--attention-backend flashinfer: {num_qo_heads} query heads are not a multiple of {num_kv_heads}"
    return None


@functools.cache
def import_problem() -> str | None:
    """Why ``import flashinfer`` fails here (one line), or ``None`` when it works. Cached: it takes seconds."""
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # not only ImportError: a broken dependency (tvm_ffi, nvml) raises other errors
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"--attention-backend flashinfer needs the flashinfer-python package, which failed to import: {detail}"
    return None


def unavailable_reason(
    device: torch.device, dtype: torch.dtype, num_qo_heads: int, num_kv_heads: int, head_dim: int
) -> str | None:
    """Why :class:`FlashInferAttnBackend` cannot run here (one line), or ``None``; ``auto`` uses it to choose."""
    if device.type != "cuda":
        return f"--attention-backend flashinfer needs a CUDA device, not {device.type}; use torch_native on CPU"
    if not torch.cuda.is_available():
        return "--attention-backend flashinfer needs CUDA, which is not available on this machine"
    return config_problem(dtype, num_qo_heads, num_kv_heads, head_dim) or import_problem()
