"""Open a model spec (directory, .gguf, built-in name, hub id or ``random:PRESET``) and build our decoder from it.

Shared by the engine (the target model) and speculative decoding (the draft model), so both resolve, read and
load a spec the same way.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoTokenizer

from batchgen.errors import BatchgenError, one_line
from batchgen.kernels.attention import deterministic_backend
from batchgen.kernels.cpu import fused_elementwise as cpu_ops
from batchgen.kernels.switches import TRITON_FUSED_OPS, KernelSwitches
from batchgen.models.llama import DecoderLayer, LlamaForCausalLM
from batchgen.models.loader import load_model, random_model
from batchgen.models.packed_linear import PackedLinear, cpu_gemm_dtype, half_weight_runs
from batchgen.models.random_presets import is_random_spec, random_preset_config
from batchgen.models.resolve import resolve_model
from batchgen.models.row_invariant import silu_and_mul_by_rows


def triton_fused_ops_requested(device: torch.device, switches: KernelSwitches) -> bool:
    """Whether to run RMSNorm, SiLU-and-multiply and RoPE as one Triton kernel each
    (:meth:`LlamaForCausalLM.use_fused_ops`): by default on a CUDA device where triton imports (on an H200 they made
    CUDA-graph decode steps of Llama-1B 1.29-1.59x faster, docs/performance.md); ``switches.triton_fused_ops``
    (``$BATCHGEN_TRITON_FUSED_OPS``) off turns them off, on insists on them.

    Raises:
        BatchgenError: on asked for on the CPU outside Triton's interpreter (``TRITON_INTERPRET=1``, the only way
            Triton runs CPU tensors, for tests); or without triton installed.
    """
    if switches.triton_fused_ops is None:
        return device.type == "cuda" and importlib.util.find_spec("triton") is not None
    if not switches.triton_fused_ops:
        return False
    if device.type == "cpu" and not switches.triton_interpret:
        raise BatchgenError(
            f"{TRITON_FUSED_OPS}=1 needs a CUDA device: unset it on the CPU (where Triton runs only interpreted, "
            "with TRITON_INTERPRET=1, slowly, for tests)"
        )
    if importlib.util.find_spec("triton") is None:
        raise BatchgenError(f"{TRITON_FUSED_OPS}=1 needs triton (pip install triton)")
    return True


@dataclass
class ModelSource:
    """A resolved model spec, before its weights are loaded.

    Attributes:
        spec: what the user passed.
        model_dir: the local checkpoint directory; ``None`` for ``random:`` presets.
        hf_config: its transformers config.
        tokenizer: its transformers tokenizer; ``None`` for ``random:`` presets (they have none).
    """

    spec: str
    model_dir: Path | None
    hf_config: Any
    tokenizer: Any

    @classmethod
    def open(cls, spec: str) -> ModelSource:
        """Resolve ``spec`` and read its config and tokenizer (no weights yet).

        Raises:
            BatchgenError: the spec matches no model, or its config or tokenizer cannot be read.
        """
        if is_random_spec(spec):
            return cls(spec, None, random_preset_config(spec), None)
        model_dir = resolve_model(spec)
        try:
            hf_config = AutoConfig.from_pretrained(model_dir)
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError, KeyError, StrictDataclassError) as e:
            # A config that transformers' own checks refuse (Phi-3's RoPE types) says why in the error it wraps.
            why = e.__cause__ if isinstance(e, StrictDataclassError) and e.__cause__ is not None else e
            raise BatchgenError(f"{model_dir}: cannot load the config or tokenizer: {one_line(why)}") from None
        return cls(spec, model_dir, hf_config, tokenizer)

    def load(
        self,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        switches: KernelSwitches,
        deterministic: bool = False,
        attention_backend: str = "auto",
    ) -> LlamaForCausalLM:
        """The decoder on ``device`` in ``dtype``, with RoPE tables for ``max_positions`` positions: the
        checkpoint's weights, or random ones (seed 0) for a ``random:`` preset; linear weights on the CPU prepacked
        for oneDNN (:mod:`batchgen.models.packed_linear`; bfloat16 and float16 ones as float32 where oneDNN has no
        kernels for the dtype); bfloat16 models run with the CPU's fused elementwise kernels
        (:mod:`batchgen.kernels.cpu.fused_elementwise`, where they build; RoPE stores the new K/V); Triton's fused
        kernels on CUDA (:func:`triton_fused_ops_requested`); each unless ``switches`` turns it off.

        ``deterministic``: a row's outputs must not depend on the row count. With torch_native (the CPU; see
        :func:`batchgen.kernels.attention.deterministic_backend` for ``attention_backend``) every linear layer,
        float32 ones too, is packed and pads single rows (:mod:`batchgen.models.packed_linear`). With triton (CUDA,
        or the CPU in Triton's interpreter) every linear layer and the LM head run Triton's batch-invariant GEMM
        (:mod:`batchgen.kernels.triton.matmul`) and the norms, SiLU and RoPE its per-row fused kernels (torch's
        CUDA reductions choose their split by the row count).

        Raises:
            BatchgenError: unsupported architecture, missing / mis-shaped weights (see ``load_model``), fused
                kernels asked for where Triton cannot run them (see :func:`triton_fused_ops_requested`), or turned
                off where ``deterministic`` needs them.
        """
        if self.model_dir is None:
            model = random_model(self.hf_config, dtype, device, max_positions)
        else:
            model = load_model(self.model_dir, self.hf_config, dtype, device, max_positions)
        if deterministic and deterministic_backend(attention_backend, device) == "triton":
            if importlib.util.find_spec("triton") is None:
                raise BatchgenError("--deterministic with attention backend triton needs triton (pip install triton)")
            if switches.triton_fused_ops is False:
                raise BatchgenError(
                    f"--deterministic on the triton backend runs Triton's per-row norms: unset {TRITON_FUSED_OPS}=0"
                )
            from batchgen.kernels.triton import fused_elementwise as triton_ops
            from batchgen.models.triton_linear import TritonLinear

            model.use_linears(TritonLinear)
            model.use_fused_ops(triton_ops)
            return model
        gemm_dtype = cpu_gemm_dtype(dtype, device, switches.cpu_prepack, deterministic)
        if gemm_dtype is not None:
            half_weight = half_weight_runs(dtype, gemm_dtype, switches.cpu_half_weight_linear)
            model.prepack_for_cpu(gemm_dtype, deterministic, half_weight)
        if triton_fused_ops_requested(device, switches):
            from batchgen.kernels.triton import fused_elementwise as triton_ops

            model.use_fused_ops(triton_ops)
        elif switches.cpu_fused_ops and cpu_ops.fused_ops_supported(dtype, device):
            model.use_fused_ops(cpu_ops)
            _fuse_silu_into_gate_up(model)
            model.store_kv_in_rope(cpu_ops.rotary_embedding_kv)
            if gemm_dtype == torch.float32 and switches.cpu_float32_carrier:
                model.carry_float32(cpu_ops)
        elif deterministic:
            for layer in model.model.layers:  # PyTorch's SiLU, split by rows (batchgen.models.row_invariant)
                assert isinstance(layer, DecoderLayer)
                layer.mlp.silu_and_mul = silu_and_mul_by_rows
        return model


def _fuse_silu_into_gate_up(model: LlamaForCausalLM) -> None:
    """Run each layer's gate/up projection and SiLU-and-multiply as one kernel where the projection runs on brgemm
    (:meth:`batchgen.models.packed_linear.PackedLinear.silu_and_mul`): the bits of the projection then the CPU's
    SiLU-and-multiply, which ``use_fused_ops`` installed, without the projection's output passing through memory."""
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        gate_up = layer.mlp.gate_up_proj
        if isinstance(gate_up, PackedLinear) and gate_up.fuses_silu_and_mul():
            layer.mlp.gate_up_silu = gate_up.silu_and_mul
