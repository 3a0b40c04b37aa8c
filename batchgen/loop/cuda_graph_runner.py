"""The graph runner: DECODE and TARGET_VERIFY rounds padded to a few fixed shapes, replayed as CUDA graphs on GPU.

A decode step of a small model launches hundreds of short kernels; on a GPU their launch overhead, not the
math, sets the step time. Capturing the step once per batch size as a CUDA graph and replaying it removes that
overhead (the design of SGLang's ``CudaGraphRunner`` and vLLM's ``CUDAGraphRunner``). Graphs have fixed shapes
and fixed addresses, so every round is copied into static input buffers and padded up to the next captured
size. Padded rows point at request row 0 and KV slot 0, the pool's dummies: they write only slot 0 and read
only it, so they never touch a real request's cache.

Speculative decoding's TARGET_VERIFY rounds are captured too, with ``verify_tokens`` (K + 1) tokens per request:
the scheduler has the drafter pad every request's drafts to K when this runner is on (``Drafter.plan`` with
``pad``), so a verify round has the same shape as a decode round with K + 1 times the tokens. A padding
row verifies K + 1 dummy tokens at positions ``0..K``, all in slot 0.

On CPU (or with a backend that cannot be captured) the same runner works in *eager-padded* mode: the same
buffers, padding and slicing, with a direct call instead of a replay. Sampling stays outside the graph
(``ModelRunner.sample``), since it reads per-request host state (grammars, penalties).
"""

from __future__ import annotations

import bisect
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from batchgen.loop.forward_mode import ForwardMode
from batchgen.models.logits_processor import LogitsProcessorOutput

if TYPE_CHECKING:
    from batchgen.loop.forward_batch import ForwardBatch
    from batchgen.loop.model_runner import ModelRunner


def capture_batch_sizes(max_bs: int) -> list[int]:
    """``[1, 2, 4, 8, 16, 24, 32, …]`` up to ``max_bs``, ``max_bs`` itself always included (ascending)."""
    sizes = [bs for bs in (1, 2, 4, 8) if bs < max_bs] + list(range(16, max_bs, 8))
    return [*sizes, max_bs]


class CudaGraphRunner:
    """Serves DECODE (and TARGET_VERIFY) rounds of up to ``max_bs`` requests from static, padded buffers.

    Args:
        model_runner: whose model, pools and attention backend run the step.
        max_bs: the largest batch served (``--cuda-graph-max-bs`` capped by ``--max-running-requests``).
        use_cuda_graphs: capture and replay CUDA graphs (needs CUDA and a backend with
            ``supports_cuda_graph``); otherwise run eager-padded.
        verify_tokens: tokens per request of the TARGET_VERIFY rounds served (K + 1 with K draft tokens);
            0 serves DECODE rounds only.
    """

    def __init__(self, model_runner: ModelRunner, max_bs: int, use_cuda_graphs: bool, verify_tokens: int = 0) -> None:
        self.model_runner = model_runner
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = max_bs
        self.use_cuda_graphs = use_cuda_graphs
        self.verify_tokens = verify_tokens
        device = model_runner.device
        max_tokens = max_bs * max(1, verify_tokens)
        zeros = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        # Padding values: token 0 written to slot 0, in request row 0, at positions 0, 1, … within its row.
        self.input_ids = zeros.clone()
        self.positions = zeros.clone()
        self.out_cache_loc = zeros.clone()
        self.req_pool_indices = zeros[:max_bs].clone()
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=device)
        self.sample_indices = torch.arange(max_tokens, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[ForwardMode, int], torch.cuda.CUDAGraph] = {}
        self.graph_logits: dict[tuple[ForwardMode, int], torch.Tensor] = {}
        if use_cuda_graphs:
            self._capture_all()

    def modes(self) -> list[ForwardMode]:
        return [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY] if self.verify_tokens else [ForwardMode.DECODE]

    def tokens_per_request(self, mode: ForwardMode) -> int:
        return self.verify_tokens if mode.is_target_verify() else 1

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """A DECODE round, or a TARGET_VERIFY round with exactly ``verify_tokens`` tokens per request, of at most
        ``max_bs`` requests."""
        fb = forward_batch
        if fb.batch_size > self.max_bs:
            return False
        if fb.forward_mode.is_decode():
            return True
        return (
            fb.forward_mode.is_target_verify()
            and self.verify_tokens > 0
            and fb.extend_seq_lens_cpu is not None
            and all(n == self.verify_tokens for n in fb.extend_seq_lens_cpu)
        )

    def padded_size(self, batch_size: int) -> int:
        """The smallest captured size that holds ``batch_size`` rows."""
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, batch_size)]

    def run(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """Logits ``[T, vocab]`` of the round's ``T`` sampled tokens (one per request in DECODE, K + 1 per
        request in TARGET_VERIFY), computed padded and sliced back."""
        padded = self._load_inputs(forward_batch)
        if self.use_cuda_graphs:
            key = (padded.forward_mode, padded.batch_size)
            self.model_runner.attn_backend.init_forward_metadata_replay_cuda_graph(padded)
            self.graphs[key].replay()
            logits = self.graph_logits[key]
        else:
            self.model_runner.attn_backend.init_forward_metadata(padded)
            logits = self.model_runner.forward_model(padded).next_token_logits
        return LogitsProcessorOutput(logits[: forward_batch.input_ids.numel()])

    def _load_inputs(self, forward_batch: ForwardBatch) -> ForwardBatch:
        """Copy the round into the static buffers, reset the padding rows, and describe the padded batch."""
        bs = forward_batch.batch_size
        size = self.padded_size(bs)
        per_row = self.tokens_per_request(forward_batch.forward_mode)
        real = bs * per_row
        self.input_ids[:real].copy_(forward_batch.input_ids)
        self.out_cache_loc[:real].copy_(forward_batch.out_cache_loc)
        self.positions[:real].copy_(forward_batch.positions)
        self.req_pool_indices[:bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:bs].copy_(forward_batch.seq_lens)
        self._fill_padding(bs, size, per_row)
        return self._static_batch(forward_batch, size)

    def _fill_padding(self, first_row: int, size: int, per_row: int) -> None:
        """Make rows ``first_row..size-1`` padding rows of ``per_row`` tokens each."""
        start, end = first_row * per_row, size * per_row
        self.input_ids[start:end].zero_()
        self.out_cache_loc[start:end].zero_()
        self.positions[start:end].copy_(self.sample_indices[: end - start] % per_row)
        self.req_pool_indices[first_row:size].zero_()
        self.seq_lens[first_row:size].fill_(per_row)

    def _static_batch(self, template: ForwardBatch, size: int) -> ForwardBatch:
        """``template`` (a real round, or padding only) as a batch of ``size`` rows over the static buffers."""
        per_row = self.tokens_per_request(template.forward_mode)
        pad = size - template.batch_size
        extend_lens = extend_prefix_lens = None
        if per_row > 1:
            extend_lens = [per_row] * size
            extend_prefix_lens = [*(template.extend_prefix_lens_cpu or []), *[0] * pad]
        return replace(
            template,
            batch_size=size,
            input_ids=self.input_ids[: size * per_row],
            positions=self.positions[: size * per_row],
            out_cache_loc=self.out_cache_loc[: size * per_row],
            req_pool_indices=self.req_pool_indices[:size],
            req_pool_indices_cpu=template.req_pool_indices_cpu + [0] * pad,
            seq_lens=self.seq_lens[:size],
            max_seq_len=max(template.max_seq_len, per_row),
            sample_indices=self.sample_indices[: size * per_row],
            extend_seq_lens_cpu=extend_lens,
            extend_prefix_lens_cpu=extend_prefix_lens,
        )

    def _padding_batch(self, mode: ForwardMode, size: int) -> ForwardBatch:
        """A round of ``size`` padding rows only, in the static buffers (what a graph is captured from)."""
        from batchgen.loop.forward_batch import ForwardBatch

        empty = replace(ForwardBatch.dummy_decode(self.model_runner, 0), forward_mode=mode)
        if mode.is_target_verify():
            empty = replace(empty, extend_seq_lens_cpu=[], extend_prefix_lens_cpu=[])
        self._fill_padding(0, size, self.tokens_per_request(mode))
        return self._static_batch(empty, size)

    def _capture_all(self) -> None:
        """Capture one graph per mode and batch size, largest first, all allocating from one shared memory pool."""
        runner = self.model_runner
        runner.attn_backend.init_cuda_graph_state(self.max_bs, self.verify_tokens)
        pool = None
        stream = torch.cuda.Stream()
        for mode in self.modes():
            for size in reversed(self.batch_sizes):
                batch = self._padding_batch(mode, size)
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
                self.graphs[(mode, size)] = graph
                self.graph_logits[(mode, size)] = logits
        torch.cuda.synchronize()
