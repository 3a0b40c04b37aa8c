"""DECODE rounds through the decoder layers in one C++ call, where a bfloat16 model's layers are that call's ops.

A small batch's decode step is short enough that the Python between its ten ops a layer is a large part of it
(measured in docs/performance.md). Two setups of the layers run as the call's ops: on a CPU without BF16 units,
the linear layers on the model's own weights (:mod:`batchgen.kernels.cpu.half_linear`); under ``--deterministic``
where brgemm runs bfloat16, on brgemm (:mod:`batchgen.kernels.cpu.brgemm_linear`). :class:`OneCallDecode` hands such
a round's layers to :func:`batchgen.kernels.cpu.decode_layers.decode_layers`, which calls the same ops in the same order
from C++: the same bits, in less time. The embedding lookup before and the logits after stay in Python, as do
every other round and every other model setup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from batchgen.kernels.attention.base import AttentionBackend
from batchgen.kernels.attention.torch_native import TorchNativeAttnBackend
from batchgen.kernels.cpu import BrgemmRows, paged_attention_available
from batchgen.kernels.cpu.decode_layers import decode_layers
from batchgen.models.llama import DecoderLayer, LlamaForCausalLM
from batchgen.models.packed_linear import PackedLinear

if TYPE_CHECKING:
    from batchgen.loop.forward_batch import ForwardBatch


@dataclass(frozen=True)
class _LayerWeights:
    """What :func:`~batchgen.kernels.cpu.decode_layers.decode_layers` reads of one layer."""

    norms: tuple[torch.Tensor, torch.Tensor]  # input and post-attention RMSNorm weights
    weights: tuple[torch.Tensor, ...]  # the qkv, o, gate/up and down projections' packed weights
    out_features: tuple[int, ...]  # the projections' widths
    float32_carrier: bool  # packed for half_weight_linear, outputs handed on in float32; else for brgemm_linear
    gate_up_silu: bool  # the gate/up projection runs with SiLU-and-multiply in its pass (MLP.gate_up_silu)
    biases: tuple[torch.Tensor | None, torch.Tensor | None]  # qkv's and o's float32 biases


def _layer_weights(layer: nn.Module) -> _LayerWeights | None:
    """``layer``'s weights if it runs as the C++ op does (no q/k norms; either each projection runs on its
    half-precision weights and hands a float32 output on, the float32 carrier, or each runs on brgemm and rounds
    its output to bfloat16), else ``None``."""
    if not isinstance(layer, DecoderLayer) or layer.self_attn.q_norm is not None:
        return None
    packed: list[PackedLinear] = []
    own: list[torch.Tensor] = []
    brgemm: list[torch.Tensor] = []
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        if not isinstance(linear, PackedLinear):
            return None
        packed.append(linear)
        if linear.half_weight is not None and not linear.round_output:
            own.append(linear.half_weight)
        elif linear.brgemm_weight is not None and linear.round_output:
            brgemm.append(linear.brgemm_weight)
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    biases = (packed[0].bias, packed[1].bias)
    widths = tuple(p.out_features for p in packed)
    fused = layer.mlp.gate_up_silu is not None
    if len(own) == len(packed) and not fused:
        return _LayerWeights(norms, tuple(own), widths, True, fused, biases)
    if len(brgemm) == len(packed):
        return _LayerWeights(norms, tuple(brgemm), widths, False, fused, biases)
    return None


class OneCallDecode:
    """Runs the decoder layers of DECODE rounds of up to ``max_rows`` rows as one
    :func:`~batchgen.kernels.cpu.decode_layers.decode_layers` call.

    Build it with :meth:`from_model`, which says where the model's layers are exactly that op's sequence; it is
    decided once, at start-up, for the attention backend the runner was built with. ``attention_seconds``:
    ``None``, or a float64 ``[1]`` tensor to which each call adds the wall seconds of its attention (set by the
    benchmarks' attention clock, :func:`batchgen.bench.attention_time.timing_attention`).
    """

    def __init__(self, model: LlamaForCausalLM, layers: list[_LayerWeights], max_rows: int, brgemm: BrgemmRows) -> None:
        config = model.config
        self.model = model
        self.max_rows = max_rows
        self.num_heads = config.num_heads
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim**-0.5
        self.brgemm = brgemm
        self.norms = [w for layer in layers for w in layer.norms] + [model.model.norm.weight]
        self.weights = [w for layer in layers for w in layer.weights]
        self.out_features = [n for layer in layers for n in layer.out_features]
        self.float32_carrier = layers[0].float32_carrier if layers else False
        self.gate_up_silu = [layer.gate_up_silu for layer in layers]
        self.biases = [b for layer in layers for b in layer.biases]
        device = model.rotary.cos_table.device
        self.q_starts = torch.arange(max_rows, dtype=torch.int64, device=device)  # a decode row's token is its index
        self.q_lens = torch.ones(max_rows, dtype=torch.int64, device=device)
        self.attention_seconds: torch.Tensor | None = None

    @classmethod
    def from_model(
        cls, model: LlamaForCausalLM, attn_backend: AttentionBackend, max_batch: int
    ) -> OneCallDecode | None:
        """A runner for ``model``'s decode rounds of up to ``max_batch`` rows, or ``None`` unless every step of its
        layers is the C++ op's: bfloat16 on the CPU with the fused ops and their KV store in RoPE, no q/k norms,
        every linear layer running on its half-precision weights with the float32 carrier or on brgemm, and
        attention in the CPU kernel (the torch_native backend; through
        brgemm for the rows the backend runs there)."""
        dtype = model.model.embed_tokens.weight.dtype
        if not (
            model.rotary.cos_table.device.type == "cpu"
            and dtype == torch.bfloat16
            and isinstance(attn_backend, TorchNativeAttnBackend)
            and attn_backend.cpu_kernel
            and model.rotary.kv_store_kernel is not None
            and all(model.config.rope_layers)  # the op turns every layer by the one table
            and paged_attention_available()
        ):
            return None
        layers = [_layer_weights(layer) for layer in model.model.layers]
        found = [layer for layer in layers if layer is not None]
        if len(found) < len(layers):
            return None
        if max_batch == 0 or len({layer.float32_carrier for layer in found}) > 1:
            return None
        return cls(model, found, max_batch, attn_backend.kernel_brgemm(torch.bfloat16, model.config.head_dim))

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """Whether the round is a DECODE round of at most ``max_rows`` rows."""
        return forward_batch.forward_mode.is_decode() and forward_batch.batch_size <= self.max_rows

    def __call__(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """The round's final hidden states, ``[batch_size, hidden_size]`` bfloat16, as
        :meth:`batchgen.models.llama.LlamaForCausalLM.forward` returns them; the new tokens' K/V are written into
        the pool on the way. Raises ``RuntimeError`` where the op does (see
        :func:`~batchgen.kernels.cpu.decode_layers.decode_layers`)."""
        fb, n = forward_batch, forward_batch.batch_size
        pool = fb.token_to_kv_pool
        rotary = self.model.rotary
        return decode_layers(
            self.model.model.embed_tokens(fb.input_ids),
            fb.positions,
            self.norms,
            self.weights,
            self.biases,
            self.eps,
            self.num_heads,
            (rotary.cos_table, rotary.sin_table),
            (pool.k_buffer, pool.v_buffer),
            fb.out_cache_loc,
            fb.req_to_token_pool.req_to_token,
            (fb.req_pool_indices, fb.seq_lens, self.q_starts[:n], self.q_lens[:n]),
            self.scale,
            self.brgemm,
            self.out_features,
            self.float32_carrier,
            self.gate_up_silu,
            self.attention_seconds,
        )
