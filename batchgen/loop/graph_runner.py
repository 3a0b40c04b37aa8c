"""The decode graph runner: DECODE rounds padded to a few fixed batch sizes, replayed as CUDA graphs on GPU.

A decode step of a small model launches hundreds of short kernels; on a GPU their launch overhead, not the
math, sets the step time. Capturing the step once per batch size as a CUDA graph and replaying it removes that
overhead (the design of SGLang's ``CudaGraphRunner`` and vLLM's ``CUDAGraphRunner``). Graphs have fixed shapes
and fixed addresses, so every round is copied into static input buffers and padded up to the next captured
size. Padded rows point at request row 0 and KV slot 0, the pool's dummies: they write only slot 0 and read
only it, so they never touch a real request's cache.

On CPU (or with a backend that cannot be captured) the same runner works in *eager-padded* mode: the same
buffers, padding and slicing, with a direct call instead of a replay. Sampling stays outside the graph
(``ModelRunner.sample``), since it reads per-request host state (grammars, penalties).
"""

from __future__ import annotations

import bisect
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from batchgen.models.logits_processor import LogitsProcessorOutput

if TYPE_CHECKING:
    from batchgen.loop.forward_batch import ForwardBatch
    from batchgen.loop.model_runner import ModelRunner


def capture_batch_sizes(max_bs: int) -> list[int]:
    """``[1, 2, 4, 8, 16, 24, 32, …]`` up to ``max_bs``, ``max_bs`` itself always included (ascending)."""
    sizes = [bs for bs in (1, 2, 4, 8) if bs < max_bs] + list(range(16, max_bs, 8))
    return [*sizes, max_bs]


class DecodeGraphRunner:
    """Serves DECODE rounds of up to ``max_bs`` requests from static buffers padded to a captured size.

    Args:
        model_runner: whose model, pools and attention backend run the step.
        max_bs: the largest batch served (``--cuda-graph-max-bs`` capped by ``--max-running-requests``).
        use_cuda_graphs: capture and replay CUDA graphs (needs CUDA and a backend with
            ``supports_cuda_graph``); otherwise run eager-padded.
    """

    def __init__(self, model_runner: ModelRunner, max_bs: int, use_cuda_graphs: bool) -> None:
        self.model_runner = model_runner
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = max_bs
        self.use_cuda_graphs = use_cuda_graphs
        device = model_runner.device
        zeros = torch.zeros(max_bs, dtype=torch.int64, device=device)
        # Padding values: token 0 at position 0, written to slot 0, in request row 0, of length 1.
        self.input_ids = zeros.clone()
        self.positions = zeros.clone()
        self.out_cache_loc = zeros.clone()
        self.req_pool_indices = zeros.clone()
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=device)
        self.sample_indices = torch.arange(max_bs, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_logits: dict[int, torch.Tensor] = {}
        if use_cuda_graphs:
            self._capture_all()

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return forward_batch.forward_mode.is_decode() and forward_batch.batch_size <= self.max_bs

    def padded_size(self, batch_size: int) -> int:
        """The smallest captured size that holds ``batch_size`` rows."""
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, batch_size)]

    def run(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """Logits ``[batch_size, vocab]`` of a DECODE round, computed padded and sliced back."""
        bs = forward_batch.batch_size
        padded = self._load_inputs(forward_batch)
        if self.use_cuda_graphs:
            self.model_runner.attn_backend.init_forward_metadata_replay_cuda_graph(padded)
            self.graphs[padded.batch_size].replay()
            logits = self.graph_logits[padded.batch_size]
        else:
            self.model_runner.attn_backend.init_forward_metadata(padded)
            logits = self.model_runner.forward_model(padded).next_token_logits
        return LogitsProcessorOutput(logits[:bs])

    def _load_inputs(self, forward_batch: ForwardBatch) -> ForwardBatch:
        """Copy the round into the static buffers, reset the padding rows, and describe the padded batch."""
        bs = forward_batch.batch_size
        size = self.padded_size(bs)
        for static, real in (
            (self.input_ids, forward_batch.input_ids),
            (self.positions, forward_batch.positions),
            (self.out_cache_loc, forward_batch.out_cache_loc),
            (self.req_pool_indices, forward_batch.req_pool_indices),
        ):
            static[:bs].copy_(real)
            static[bs:size].zero_()
        self.seq_lens[:bs].copy_(forward_batch.seq_lens)
        self.seq_lens[bs:size].fill_(1)
        return self._static_batch(forward_batch, size)

    def _static_batch(self, template: ForwardBatch, size: int) -> ForwardBatch:
        return replace(
            template,
            batch_size=size,
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            out_cache_loc=self.out_cache_loc[:size],
            req_pool_indices=self.req_pool_indices[:size],
            req_pool_indices_cpu=template.req_pool_indices_cpu + [0] * (size - template.batch_size),
            seq_lens=self.seq_lens[:size],
            sample_indices=self.sample_indices[:size],
        )

    def _capture_all(self) -> None:
        """Capture one graph per batch size, largest first, all allocating from one shared memory pool."""
        from batchgen.loop.forward_batch import ForwardBatch
        from batchgen.loop.forward_mode import ForwardMode

        runner = self.model_runner
        runner.attn_backend.init_cuda_graph_state(self.max_bs)
        template = ForwardBatch.dummy_decode(runner, self.max_bs)
        pool = None
        stream = torch.cuda.Stream()
        for size in reversed(self.batch_sizes):
            batch = self._static_batch(replace(template, forward_mode=ForwardMode.DECODE), size)
            runner.attn_backend.init_forward_metadata_capture_cuda_graph(batch)
            # Warm-up runs on the capture stream let lazy initialisation (autotuning, workspaces) happen
            # outside the graph.
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    runner.forward_model(batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                logits = runner.forward_model(batch).next_token_logits
            pool = graph.pool()
            self.graphs[size] = graph
            self.graph_logits[size] = logits
        torch.cuda.synchronize()
