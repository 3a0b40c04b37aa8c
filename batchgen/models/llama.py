"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3) over the paged KV cache.

Follows the Hugging Face reference modules (``modeling_llama.py``, ``modeling_qwen2.py``, ``modeling_qwen3.py``,
``modeling_phi3.py``, ``modeling_smollm3.py``) in every numeric step that affects results: RMSNorm in float32, RoPE
tables in float32 cast to the activation dtype, SiLU-gated MLP. q/k/v and gate/up projections are fused into one
GEMM each (one weight read instead of three or two); the loader fills the fused weights from the checkpoint's
separate tensors, or takes Phi-3's, stored fused in the same order, by name.
:meth:`LlamaForCausalLM.use_fused_ops` swaps the RMSNorm (with the residual add before it), SiLU-and-multiply
and RoPE chains for one kernel each, Triton's (:mod:`batchgen.kernels.triton.fused_elementwise`) or the CPU's
(:mod:`batchgen.kernels.cpu.fused_elementwise`); :meth:`LlamaForCausalLM.carry_float32` then hands float32 GEMMs'
outputs to those kernels unrounded. Each layer leaves its residual add to the next layer's first norm (or the final
norm), as SGLang's and vLLM's Llama do, so that the add runs inside the fused norm.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from batchgen.models.config import ModelConfig
from batchgen.models.packed_linear import PackedLinear, prepack_linears, replace_linears
from batchgen.models.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from batchgen.loop.forward_batch import ForwardBatch


class FusedElementwiseOps(Protocol):
    """The fused kernels :meth:`LlamaForCausalLM.use_fused_ops` installs (a module with these functions)."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class Float32CarrierOps(FusedElementwiseOps, Protocol):
    """Fused kernels that also take float32 inputs, rounding them to bfloat16 as they load them, and write float32
    outputs holding bfloat16 values (:mod:`batchgen.kernels.cpu.fused_elementwise`)."""

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, gate_up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in float32 as in transformers.

    ``fused_kernel`` (set by :meth:`LlamaForCausalLM.use_fused_ops`) runs it, and the residual add of
    :meth:`add_and_norm`, as one kernel on ``[rows, dim]`` inputs.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.fused_kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_kernel is not None:
            return self.fused_kernel(x, self.weight, self.eps)[0]
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)`` for ``[rows, dim]`` inputs of one dtype."""
        if self.fused_kernel is not None:
            return self.fused_kernel(x, self.weight, self.eps, residual)
        summed = residual + x
        return self(summed), summed


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads; the attention itself runs in the round's backend."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, rotary: RotaryEmbedding, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary.kv_store_kernel is not None:  # RoPE writes the new K/V into the pool itself
            pool, tables = forward_batch.token_to_kv_pool, (rotary.cos_table, rotary.sin_table)
            kv = (pool.k_buffer[self.layer_id], pool.v_buffer[self.layer_id])
            q = rotary.kv_store_kernel(positions, q, k, v, *tables, *kv, forward_batch.out_cache_loc)
            out = forward_batch.attn_backend.forward(q, None, None, self.layer_id, forward_batch)
        else:
            q, k = rotary(positions, q, k)
            out = forward_batch.attn_backend.forward(q, k, v, self.layer_id, forward_batch)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None  # a fused kernel, when set
        self.gate_up_silu: Callable[[torch.Tensor], torch.Tensor] | None = None  # projection and activation, fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_silu is not None:
            return self.down_proj(self.gate_up_silu(x))
        gate_up = self.gate_up_proj(x)
        if self.silu_and_mul is not None:
            return self.down_proj(self.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual connection.

    ``forward(positions, hidden, residual, rotary, forward_batch)`` takes the previous layer's ``(mlp_out,
    residual)`` (``residual`` None for the first layer, whose ``hidden`` is the embedding) and returns its own:
    the layer's output is ``residual + mlp_out``, which the next norm adds.
    """

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_id)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        attended = self.self_attn(positions, normed, rotary, forward_batch)
        normed, residual = self.post_attention_layernorm.add_and_norm(attended, residual)
        return self.mlp(normed), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The Llama-family causal LM; the others differ only by config flags (biases, q/k norm, layers without RoPE).

    ``forward(input_ids [T] int64, positions [T] int64, forward_batch)`` returns the final hidden states
    ``[T, hidden_size]`` in the model dtype; logits are computed by the ``LogitsProcessor`` for the rows that
    sample only, through :meth:`compute_logits`.

    :meth:`prepack_for_cpu` swaps the linear layers (and the output projection) for oneDNN-packed ones on a CPU
    model, after the weights are loaded; :meth:`use_linears` for others (Triton's).
    """

    def __init__(self, config: ModelConfig, max_positions: int, rotary_device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head: nn.Module | None = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(config.hf_config, config.head_dim, max_positions, rotary_device)
        plain = self.rotary
        if not all(config.rope_layers):
            plain = RotaryEmbedding(config.hf_config, config.head_dim, max_positions, rotary_device, turns=False)
        self.layer_rotary = [self.rotary if turns else plain for turns in config.rope_layers]
        self.tied_lm_head: nn.Module | None = None  # the tied output projection, packed or swapped

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[rows, vocab_size]`` logits in the model dtype for hidden states ``[rows, hidden_size]``: the output
        projection, or the tied input embedding."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if self.tied_lm_head is not None:
            return self.tied_lm_head(hidden)
        return F.linear(hidden, self.model.embed_tokens.weight)

    def prepack_for_cpu(self, gemm_dtype: torch.dtype, deterministic: bool = False, half_weight: bool = False) -> None:
        """Pack every linear weight for GEMMs in ``gemm_dtype``, batch invariant with ``deterministic``, on the
        half-precision weights with ``half_weight`` (see :mod:`batchgen.models.packed_linear`);
        a tied output projection is packed from a copy, since the embedding keeps its own weight for lookups."""
        prepack_linears(self, gemm_dtype, deterministic, half_weight)
        if self.lm_head is None:
            weight = self.model.embed_tokens.weight
            self.tied_lm_head = PackedLinear(weight, None, gemm_dtype, half_weight, deterministic)

    def use_linears(self, make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]) -> None:
        """Run every linear layer and the output projection (a tied one sharing the embedding's weight) as
        ``make(weight, bias)``: :class:`batchgen.models.triton_linear.TritonLinear` under ``--deterministic``."""
        replace_linears(self, lambda linear: make(linear.weight, linear.bias))
        if self.lm_head is None:
            self.tied_lm_head = make(self.model.embed_tokens.weight, None)

    def use_fused_ops(self, ops: FusedElementwiseOps) -> None:
        """Run every layer's RMSNorms (the second with its residual add), SiLU-and-multiply and RoPE, and the final
        norm, as one kernel each from ``ops``: about 12 kernels a layer instead of 42 (q/k norms stay in torch).
        ``ops`` is :mod:`batchgen.kernels.triton.fused_elementwise` (CUDA tensors, or CPU ones under
        ``TRITON_INTERPRET=1``) or :mod:`batchgen.kernels.cpu.fused_elementwise` (bfloat16 on the CPU)."""
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.input_layernorm.fused_kernel = ops.rms_norm
            layer.post_attention_layernorm.fused_kernel = ops.rms_norm
            layer.mlp.silu_and_mul = ops.silu_and_mul
        self.model.norm.fused_kernel = ops.rms_norm
        for rotary in {self.rotary, *self.layer_rotary}:
            rotary.fused_kernel = ops.rotary_embedding

    def store_kv_in_rope(self, kernel: Callable[..., torch.Tensor]) -> None:
        """Let ``kernel`` (:func:`batchgen.kernels.cpu.fused_elementwise.rotary_embedding_kv`) rotate q and k and
        write the new tokens' K/V into the KV pool in one pass, instead of RoPE then the backend's store; for a
        model whose KV pool has its dtype on its device (bfloat16 on the CPU)."""
        for rotary in {self.rotary, *self.layer_rotary}:
            rotary.kv_store_kernel = kernel

    def carry_float32(self, ops: Float32CarrierOps) -> None:
        """Carry activations in float32 between float32 GEMMs and ``ops``' kernels, after :meth:`prepack_for_cpu`
        packed the linears as float32 GEMMs for this bfloat16 model and :meth:`use_fused_ops` installed ``ops``.

        The q/k/v (unless q/k norms, which run in torch, follow), o, gate/up and down projections hand their
        float32 outputs on unrounded, and the kernels round them to bfloat16 as they load them; the layer norms
        and SiLU-and-multiply write float32 outputs holding bfloat16 values for the next GEMM. Every value is
        that of the all-bfloat16 chain (the same logits, bit for bit), without the casts before and after each
        GEMM that took 4-9 % of a CPU step. The residual stream, the KV cache and the final hidden states stay
        bfloat16.
        """

        def _keep_float32(linear: nn.Module) -> None:
            assert isinstance(linear, PackedLinear) and linear.gemm_dtype == torch.float32
            linear.round_output = False

        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            if layer.self_attn.q_norm is None:
                _keep_float32(layer.self_attn.qkv_proj)
            for linear in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                _keep_float32(linear)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.fused_kernel = functools.partial(ops.rms_norm, out_dtype=torch.float32)
            layer.mlp.silu_and_mul = functools.partial(ops.silu_and_mul, out_dtype=torch.float32)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.model.embed_tokens(input_ids), None
        for layer, rotary in zip(self.model.layers, self.layer_rotary, strict=True):
            hidden, residual = layer(positions, hidden, residual, rotary, forward_batch)
        if residual is None:  # a model of no layers
            return self.model.norm(hidden)
        return self.model.norm.add_and_norm(hidden, residual)[0]
