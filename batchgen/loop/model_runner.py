"""``ModelRunner``: owns the model, the KV pools and the attention backend; runs forward and sample."""

from __future__ import annotations

import torch

from batchgen.kernels.attention import create_attention_backend
from batchgen.kernels.switches import KernelSwitches
from batchgen.loop.cuda_graph_runner import CudaGraphRunner
from batchgen.loop.forward_batch import ForwardBatch
from batchgen.loop.huge_pages import move_to_huge_pages
from batchgen.loop.kv_pool import ReqToTokenPool, TokenToKVPool
from batchgen.models.llama import LlamaForCausalLM
from batchgen.models.logits_processor import LogitsProcessor, LogitsProcessorOutput
from batchgen.models.one_call_decode import OneCallDecode
from batchgen.sampling.sampler import SampleOutput, sample
from batchgen.sampling.sampling_batch_info import SamplingBatchInfo


class ModelRunner:
    """How one round runs: ``forward(ForwardBatch) → LogitsProcessorOutput``, then ``sample``.

    Args:
        model: the decoder, already on ``device`` in ``dtype``.
        kv_pool_size: number of KV slots (tokens) in the pool.
        max_running_requests: rows of ``req_to_token``.
        context_len: columns of ``req_to_token``: the longest prompt + output.
        attention_backend: a name accepted by :func:`create_attention_backend`.
        cuda_graph_max_bs: DECODE rounds of up to this many requests run through the
            :class:`CudaGraphRunner` (CUDA graphs where the device and backend allow, else eager-padded);
            0 runs every round eagerly at its own size.
        verify_tokens: with speculative decoding, K + 1: TARGET_VERIFY rounds with that many tokens per request
            go through the graph runner too (unless the context is too short for any such round).
        switches: the kernel switches of the attention backend and of greedy sampling's argmax.
        deterministic: attention whose result for a row depends on that row only (``--deterministic``).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        device: torch.device,
        dtype: torch.dtype,
        kv_pool_size: int,
        max_running_requests: int,
        context_len: int,
        attention_backend: str,
        cuda_graph_max_bs: int = 0,
        verify_tokens: int = 0,
        switches: KernelSwitches = KernelSwitches(),
        deterministic: bool = False,
    ) -> None:
        config = model.config
        self.switches = switches
        self.deterministic = deterministic
        if device.type == "cpu":
            move_to_huge_pages(model)  # a decode step reads every weight: fewer TLB misses (huge_pages.py)
        self.model = model
        self.device = device
        self.dtype = dtype
        self.vocab_size = config.vocab_size
        self.req_to_token_pool = ReqToTokenPool(max_running_requests, context_len, device)
        self.token_to_kv_pool = TokenToKVPool(
            kv_pool_size, config.num_layers, config.num_kv_heads, config.head_dim, dtype, device
        )
        self.attn_backend = create_attention_backend(attention_backend, device, dtype, config, switches, deterministic)
        self.logits_processor = LogitsProcessor()
        self.one_call_decode = OneCallDecode.from_model(model, self.attn_backend, max_running_requests)
        self.graph_runner: CudaGraphRunner | None = None
        if cuda_graph_max_bs > 0:
            use_graphs = device.type == "cuda" and self.attn_backend.supports_cuda_graph
            with torch.inference_mode():
                # A uniform verify round needs a prompt token, a pending token and K drafts within the context.
                verify_tokens = verify_tokens if verify_tokens + 1 <= context_len else 0
                self.graph_runner = CudaGraphRunner(
                    self, min(cuda_graph_max_bs, max_running_requests), use_graphs, verify_tokens
                )

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """Run the model over the round's tokens; logits only for ``forward_batch.sample_indices``.

        DECODE and uniform TARGET_VERIFY rounds the graph runner can serve go through it (on a CPU only with
        ``--cuda-graph-max-bs``); on a CPU, DECODE rounds whose layers are the ops of :class:`OneCallDecode` (on
        the half-precision weights, or on ``--deterministic``'s brgemm) run them in one C++ call; the rest plan
        their attention and run eagerly.
        """
        if self.graph_runner is not None and self.graph_runner.can_run(forward_batch):
            return self.graph_runner.run(forward_batch)
        if self.one_call_decode is not None and self.one_call_decode.can_run(forward_batch):
            hidden = self.one_call_decode(forward_batch)
            return self.logits_processor(hidden, self.model.compute_logits, forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.forward_model(forward_batch)

    def forward_model(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """The model and logits processor over a batch whose attention metadata is planned.

        Reads nothing back to the host in a DECODE or TARGET_VERIFY round, so the graph runner can capture it.
        """
        hidden = self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
        return self.logits_processor(hidden, self.model.compute_logits, forward_batch)

    @torch.inference_mode()
    def sample(self, logits_output: LogitsProcessorOutput, sampling_info: SamplingBatchInfo) -> SampleOutput:
        """Choose the next token of every sampled row (see :func:`batchgen.sampling.sampler.sample`)."""
        return sample(logits_output.next_token_logits, sampling_info, self.switches.cpu_attention_kernel)
