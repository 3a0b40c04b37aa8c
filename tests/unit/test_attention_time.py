"""The benchmarks' attention clock: it counts the time spent inside the backend's calls, and nothing else changes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen.bench.attention_time import AttentionClock, TimedAttentionBackend, timing_attention
from batchgen.kernels.attention.base import AttentionBackend
from batchgen.loop.engine import Engine
from batchgen.loop.options import EngineOptions
from batchgen.loop.req import Req
from batchgen.sampling.sampling_params import SamplingParams
from batchgen.speculative import make_drafter

FORWARD_SLEEP = 0.01
METADATA_SLEEP = 0.005


class _SleepingBackend(AttentionBackend):
    """Each round's planning sleeps 5 ms and each layer's attention 10 ms; returns q."""

    def init_forward_metadata(self, forward_batch: Any) -> None:
        time.sleep(METADATA_SLEEP)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, forward_batch: Any) -> Any:
        time.sleep(FORWARD_SLEEP)
        return q

    def forward_extend(self, q: torch.Tensor, layer_id: int, forward_batch: Any) -> torch.Tensor:
        raise AssertionError("the base's forward is not called: this backend's forward replaces it")

    def forward_decode(self, q: torch.Tensor, layer_id: int, forward_batch: Any) -> torch.Tensor:
        raise AssertionError("the base's forward is not called: this backend's forward replaces it")


class _ManualTime:
    """``time`` for this test and the clock's module: ``perf_counter`` moves only by what ``sleep`` is given, so the
    seconds counted are the sleeps' own length, whatever a loaded machine's wake-ups add."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_clock_counts_the_time_inside_the_backend_calls_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """3 rounds of 4 layers: 3 x 5 ms of planning and 12 x 10 ms of attention = 135 ms by the sleeps' own
    length; the 60 ms slept between the calls, outside the backend, are not counted."""
    from batchgen.bench import attention_time

    manual = _ManualTime()
    monkeypatch.setattr(attention_time, "time", manual)
    monkeypatch.setitem(globals(), "time", manual)  # the backend's sleeps and the ones between its calls
    clock = AttentionClock()
    timed = TimedAttentionBackend(_SleepingBackend(), torch.device("cpu"), clock)
    q = torch.arange(6.0).view(1, 2, 3)
    for _ in range(3):
        timed.init_forward_metadata(None)  # type: ignore[arg-type]
        for layer in range(4):
            assert timed.forward(q, q, q, layer, None) is q  # type: ignore[arg-type]
            time.sleep(0.005)
    expected = 3 * METADATA_SLEEP + 12 * FORWARD_SLEEP
    # Timed by wall clock, the sleeps overran by their wake-ups on a loaded machine, and a bound with room for
    # them still had to stay below the 60 ms slept outside: on the manual clock the count is exact.
    assert manual.now == pytest.approx(expected + 12 * 0.005)
    assert clock.seconds == pytest.approx(expected)


def _greedy_tokens(engine: Engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True, logprobs=False)
    for i, prompt in enumerate(prompts):
        engine.add(Req(str(i), prompt, params, i, frozenset(), engine.context_len))
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        tokens.update((req.rid, list(req.output_ids)) for req in engine.step())
    return tokens


def test_timing_changes_no_token_and_puts_the_backends_back(random_models: dict[str, Path]) -> None:
    """Greedy float32 with a draft model (the target itself): the same tokens with and without the clock; inside
    the block the target's and the draft's backends are both timed, after it they are the originals again."""
    model = str(random_models["llama"])
    options = EngineOptions(
        model=model,
        dtype="float32",
        device="cpu",
        max_total_tokens=400,
        prefix_cache=False,
        speculative_algorithm="draft",
        speculative_draft_model=model,
    )
    engine = Engine(options, make_drafter)
    draft_runner = engine.scheduler.drafter.runner  # type: ignore[union-attr]
    runners = [engine.runner, draft_runner]
    originals = [r.attn_backend for r in runners]
    prompts = [[(7 * i + j) % 50 + 1 for j in range(6 + 3 * i)] for i in range(3)]
    plain = _greedy_tokens(engine, prompts)
    with timing_attention(engine) as clock:
        assert [type(r.attn_backend) for r in runners] == [TimedAttentionBackend] * 2
        timed = _greedy_tokens(engine, prompts)
    assert timed == plain and len(plain) == 3
    assert clock.seconds > 0
    assert [r.attn_backend for r in runners] == originals
