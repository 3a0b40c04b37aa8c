"""``ForwardBatch``: the low-level tensors of one round, on the model's device, owned by the ModelRunner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from batchgen.loop.forward_mode import ForwardMode

if TYPE_CHECKING:
    from batchgen.kernels.attention.base import AttentionBackend
    from batchgen.loop.kv_pool import ReqToTokenPool, TokenToKVPool
    from batchgen.loop.model_runner import ModelRunner
    from batchgen.loop.schedule_batch import ModelWorkerBatch


@dataclass
class ForwardBatch:
    """Everything ``ModelRunner.forward`` reads, prepared before the model runs (no host sync inside).

    Token-level tensors have ``T`` rows (all tokens of the round, requests back to back); request-level ones
    have ``batch_size`` rows. All int64.

    Attributes:
        input_ids, positions, out_cache_loc: ``[T]`` token ids, their positions, the KV slots they write.
        req_pool_indices, seq_lens: ``[batch_size]`` request rows in ``req_to_token`` and sequence lengths
            after this round (cached prefix + new tokens).
        max_seq_len: host int, ``max(seq_lens)``: the width attention gathers without reading ``seq_lens``.
        sample_indices: ``[num_sampled]`` rows of the hidden states whose logits are computed.
        prompt_logprob_indices, prompt_logprob_targets: ``[m]`` rows whose next prompt token's logprob is wanted,
            and those tokens; prompt_top_k: host int, top logprobs to report for them.
        extend_*_cpu: host lists for EXTEND/MIXED rounds (per-request shapes the kernels loop over).
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    req_pool_indices_cpu: list[int]
    seq_lens: torch.Tensor
    max_seq_len: int
    sample_indices: torch.Tensor
    prompt_logprob_indices: torch.Tensor
    prompt_logprob_targets: torch.Tensor
    prompt_top_k: int
    extend_seq_lens_cpu: list[int] | None
    extend_prefix_lens_cpu: list[int] | None
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    attn_backend: AttentionBackend

    @classmethod
    def init_new(cls, batch: ModelWorkerBatch, model_runner: ModelRunner) -> ForwardBatch:
        """Move ``batch``'s CPU tensors to the runner's device; ``ModelRunner.forward`` plans the attention."""
        device = model_runner.device

        def to_device(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return cls(
            forward_mode=batch.forward_mode,
            batch_size=len(batch.req_pool_indices_cpu),
            input_ids=to_device(batch.input_ids),
            positions=to_device(batch.positions),
            out_cache_loc=to_device(batch.out_cache_loc),
            req_pool_indices=to_device(torch.tensor(batch.req_pool_indices_cpu, dtype=torch.int64)),
            req_pool_indices_cpu=batch.req_pool_indices_cpu,
            seq_lens=to_device(torch.tensor(batch.seq_lens_cpu, dtype=torch.int64)),
            max_seq_len=max(batch.seq_lens_cpu),
            sample_indices=to_device(batch.sample_indices),
            prompt_logprob_indices=to_device(batch.prompt_logprob_indices),
            prompt_logprob_targets=to_device(batch.prompt_logprob_targets),
            prompt_top_k=batch.prompt_top_k,
            extend_seq_lens_cpu=batch.extend_seq_lens_cpu,
            extend_prefix_lens_cpu=batch.extend_prefix_lens_cpu,
            req_to_token_pool=model_runner.req_to_token_pool,
            token_to_kv_pool=model_runner.token_to_kv_pool,
            attn_backend=model_runner.attn_backend,
        )

    @classmethod
    def dummy_decode(cls, model_runner: ModelRunner, batch_size: int) -> ForwardBatch:
        """A DECODE round of ``batch_size`` padding rows (token 0 → slot 0, request row 0), for graph capture."""
        device = model_runner.device
        zeros = torch.zeros(batch_size, dtype=torch.int64, device=device)
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return cls(
            forward_mode=ForwardMode.DECODE,
            batch_size=batch_size,
            input_ids=zeros,
            positions=zeros,
            out_cache_loc=zeros,
            req_pool_indices=zeros,
            req_pool_indices_cpu=[0] * batch_size,
            seq_lens=torch.ones(batch_size, dtype=torch.int64, device=device),
            max_seq_len=1,
            sample_indices=torch.arange(batch_size, device=device),
            prompt_logprob_indices=empty,
            prompt_logprob_targets=empty,
            prompt_top_k=0,
            extend_seq_lens_cpu=None,
            extend_prefix_lens_cpu=None,
            req_to_token_pool=model_runner.req_to_token_pool,
            token_to_kv_pool=model_runner.token_to_kv_pool,
            attn_backend=model_runner.attn_backend,
        )
