"""The benchmarks' attention clock: wall time spent inside the engine's attention backends, so ``bench-one-batch``
and ``bench --roofline`` can report attention's share of a run without a profiler."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from batchgen.kernels.attention.base import AttentionBackend
from batchgen.loop.engine import Engine
from batchgen.speculative.draft_model import DraftModelDrafter

if TYPE_CHECKING:
    from batchgen.loop.forward_batch import ForwardBatch
    from batchgen.loop.model_runner import ModelRunner

_Out = TypeVar("_Out")


@dataclass
class AttentionClock:
    """Seconds (wall clock, ``time.perf_counter``) spent in the timed attention backends; those a
    :class:`~batchgen.models.one_call_decode.OneCallDecode` call spends in attention are added when the
    :func:`timing_attention` block ends, so read it after the block."""

    seconds: float = 0.0


class TimedAttentionBackend(AttentionBackend):
    """Delegates every call to ``inner`` and adds the wall time of its attention work to ``clock``.

    Timed: :meth:`init_forward_metadata` (the round's planning is part of attention's cost) and :meth:`forward` as
    a whole. ``inner.forward`` stores the new tokens' K/V and then calls ``inner``'s own ``forward_extend`` or
    ``forward_decode``, out of this wrapper's reach, and a backend may store K/V with a kernel of its own (the
    Triton one does): so the store is counted in, for every backend alike. ``forward_extend`` and
    ``forward_decode`` called on the wrapper itself are timed too. Untimed: the CUDA-graph setup and replay hooks
    (a replayed round's attention runs inside the graph, out of the clock's sight). On CUDA each timed call
    synchronizes the device before and after, so the clock sees the kernels rather than their launches; CPU ops
    are synchronous. The wrapper changes no output: every call returns ``inner``'s result.
    """

    def __init__(self, inner: AttentionBackend, device: torch.device, clock: AttentionClock) -> None:
        self.inner = inner
        self.device = device
        self.clock = clock

    def _timed(self, fn: Callable[[], _Out]) -> _Out:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize(self.device)
        self.clock.seconds += time.perf_counter() - start
        return out

    def init_cuda_graph_state(self, max_bs: int, verify_tokens: int = 0) -> None:
        self.inner.init_cuda_graph_state(max_bs, verify_tokens)

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        self.inner.init_forward_metadata_capture_cuda_graph(forward_batch)

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        self.inner.init_forward_metadata_replay_cuda_graph(forward_batch)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self._timed(lambda: self.inner.init_forward_metadata(forward_batch))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer_id: int,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        return self._timed(lambda: self.inner.forward(q, k, v, layer_id, forward_batch))

    def forward_extend(self, q: torch.Tensor, layer_id: int, forward_batch: ForwardBatch) -> torch.Tensor:
        return self._timed(lambda: self.inner.forward_extend(q, layer_id, forward_batch))

    def forward_decode(self, q: torch.Tensor, layer_id: int, forward_batch: ForwardBatch) -> torch.Tensor:
        return self._timed(lambda: self.inner.forward_decode(q, layer_id, forward_batch))


def _runners(engine: Engine) -> list[ModelRunner]:
    """The engine's runner, and its draft model's (whose attention is part of a speculative run's too)."""
    drafter = engine.scheduler.drafter
    return [engine.runner] + ([drafter.runner] if isinstance(drafter, DraftModelDrafter) else [])


def graphs_hide_attention(engine: Engine) -> bool:
    """Whether a runner of ``engine`` replays CUDA graphs: their DECODE and TARGET_VERIFY rounds never call the
    Python backend, so :func:`timing_attention` misses their attention and the share of a part with such rounds
    is not measurable this way (the benchmarks report ``None``)."""
    return any(r.graph_runner is not None and r.graph_runner.use_cuda_graphs for r in _runners(engine))


@contextmanager
def timing_attention(engine: Engine) -> Iterator[AttentionClock]:
    """Within the block, every attention backend of ``engine`` (the target's, and a draft model's) is wrapped in a
    :class:`TimedAttentionBackend` sharing one :class:`AttentionClock` (at 0 seconds), which the block gets; the
    backends are put back after it. A round builds its ``ForwardBatch`` from its runner's backend, so the rounds
    run inside the block are timed (but see :func:`graphs_hide_attention`); so are the rounds a runner's
    :class:`~batchgen.models.one_call_decode.OneCallDecode` serves, whose C++ call times its own attention."""
    runners = _runners(engine)
    clock = AttentionClock()
    originals = [r.attn_backend for r in runners]
    for runner, backend in zip(runners, originals):
        runner.attn_backend = TimedAttentionBackend(backend, runner.device, clock)
    # CPU decode rounds of one C++ call run their attention inside it, which times it itself.
    one_call = [r.one_call_decode for r in runners if r.one_call_decode is not None]
    for decode in one_call:
        decode.attention_seconds = torch.zeros(1, dtype=torch.float64)
    try:
        yield clock
    finally:
        for runner, backend in zip(runners, originals):
            runner.attn_backend = backend
        for decode in one_call:
            assert decode.attention_seconds is not None
            clock.seconds += float(decode.attention_seconds)
            decode.attention_seconds = None


def attention_text(share: float | None) -> str:
    """``attention 23%``, or ``attention n/a (CUDA graphs)`` where the share was not measurable."""
    return "attention n/a (CUDA graphs)" if share is None else f"attention {share:.0%}"
