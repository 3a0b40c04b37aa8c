"""``batchgen bench-one-batch``: one static batch straight through ForwardBatch → forward → sample, no scheduler
(as SGLang's ``bench_one_batch``): prefill latency, decode step latencies, achieved bandwidth and FLOP/s.

With speculative decoding on, the decode steps are the engine's own rounds (its scheduler drafts, verifies and
rolls back the KV of rejected drafts), so each timed step is a TARGET_VERIFY round (with the draft model's
steps) or a plain DECODE round, and the case reports the acceptance as ``batchgen run`` does."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TypeVar

import torch

from batchgen.bench.attention_time import attention_text, graphs_hide_attention, timing_attention
from batchgen.bench.model_costs import decode_bytes, forward_flops
from batchgen.bench.probes import Ceilings
from batchgen.job.summary import speculative_summary
from batchgen.loop.engine import Engine
from batchgen.loop.forward_batch import ForwardBatch
from batchgen.loop.forward_mode import ForwardMode
from batchgen.loop.req import Req
from batchgen.loop.schedule_batch import ScheduleBatch
from batchgen.models.packed_linear import PackedLinear, cpu_gemm_dtype
from batchgen.sampling.sampler import SampleOutput
from batchgen.sampling.sampling_params import SamplingParams

FIRST_DECODE_STEPS = 3
_Out = TypeVar("_Out")


@dataclass
class OneBatchResult:
    """One case. Latencies in seconds, throughputs in tokens/s, bandwidth in GB/s, compute in TFLOP/s;
    ``*_fraction`` is the share of the measured ceiling (``matmul_ceiling_tflops``, ``copy_ceiling_gbs``). The
    decode figures are ``None`` for ``output_len`` 1 (the prefill samples the only token: no decode step is
    timed). ``input_len`` tokens per request are prefilled in the timed round, after ``prefix_len`` tokens whose
    K/V are already in the pool (an untimed earlier round, as a prefix cache hit leaves them): the prefill figures
    count the ``input_len`` tokens only. ``*_attention_share``: the part's seconds inside the attention backends
    (:func:`~batchgen.bench.attention_time.timing_attention`) over its wall time; the decode one ``None`` where
    CUDA graphs replay the decode rounds (their attention is not timed) or no decode step ran."""

    batch_size: int
    prefix_len: int
    input_len: int
    output_len: int
    prefill_latency: float
    prefill_throughput: float
    first_decode_latencies: list[float]
    median_decode_latency: float | None
    decode_throughput: float | None
    total_latency: float
    total_throughput: float
    decode_bandwidth_gbs: float | None
    prefill_tflops: float
    matmul_ceiling_tflops: float
    copy_ceiling_gbs: float
    prefill_attention_share: float
    decode_attention_share: float | None
    accept_histogram: dict[int, int] | None = None

    @property
    def prefill_flops_fraction(self) -> float:
        return self.prefill_tflops / self.matmul_ceiling_tflops

    @property
    def decode_bandwidth_fraction(self) -> float | None:
        return None if self.decode_bandwidth_gbs is None else self.decode_bandwidth_gbs / self.copy_ceiling_gbs

    def above(self, ceilings: Ceilings) -> bool:
        """Whether this case ran faster than ``ceilings`` allow: the probe caught the machine in a slow moment, or
        the case beat it (weights in cache)."""
        over_copy = self.decode_bandwidth_gbs is not None and self.decode_bandwidth_gbs * 1e9 > ceilings.copy_bandwidth
        return self.prefill_tflops * 1e12 > ceilings.matmul_flops or over_copy

    def against(self, ceilings: Ceilings) -> OneBatchResult:
        """This case with its fractions of ``ceilings``."""
        return replace(
            self, matmul_ceiling_tflops=ceilings.matmul_flops / 1e12, copy_ceiling_gbs=ceilings.copy_bandwidth / 1e9
        )

    def line(self) -> str:
        return (
            f"bs={self.batch_size}{f' prefix={self.prefix_len}' if self.prefix_len else ''} in={self.input_len} "
            f"out={self.output_len} | "
            f"prefill {self.prefill_latency * 1e3:.1f} ms "
            f"{self.prefill_throughput:.0f} tok/s ({self.prefill_tflops:.3f} TFLOP/s, "
            f"{self.prefill_flops_fraction:.0%} of peak, {attention_text(self.prefill_attention_share)}) | "
            f"{self._decode()} | total "
            f"{self.total_latency:.2f} s {self.total_throughput:.0f} tok/s"
        ) + self._acceptance()

    def _decode(self) -> str:
        fraction = self.decode_bandwidth_fraction
        if (
            self.median_decode_latency is None
            or self.decode_throughput is None
            or self.decode_bandwidth_gbs is None
            or fraction is None
        ):
            return "decode n/a (one output token: the prefill samples it)"
        first = ", ".join(f"{t * 1e3:.1f}" for t in self.first_decode_latencies)
        return (
            f"decode first [{first}] ms, median {self.median_decode_latency * 1e3:.2f} ms "
            f"{self.decode_throughput:.0f} tok/s ({self.decode_bandwidth_gbs:.1f} GB/s, "
            f"{fraction:.0%} of copy bw, {attention_text(self.decode_attention_share)})"
        )

    def _acceptance(self) -> str:
        """The speculative cases' acceptance; said too when no round verified a draft (every one was held back)."""
        if self.accept_histogram is None:
            return ""
        return speculative_summary(self.accept_histogram) or ", no drafts verified"

    def as_dict(self) -> dict[str, object]:
        """The measurements and the ceilings (the acceptance goes to the result file with the speculative
        settings)."""
        record = {k: v for k, v in asdict(self).items() if k != "accept_histogram"}
        record.update(
            prefill_flops_fraction=self.prefill_flops_fraction, decode_bandwidth_fraction=self.decode_bandwidth_fraction
        )
        return record


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class OneBatchRunner:
    """Runs static batches on an :class:`Engine`'s ModelRunner and pools, bypassing its scheduler."""

    def __init__(self, engine: Engine, seed: int = 0) -> None:
        self.engine, self.rng = engine, random.Random(seed)
        # What the GEMMs read: the model's weights, or float32 copies where they run in float32 on oneDNN.
        packed = [m for m in engine.runner.model.modules() if isinstance(m, PackedLinear)]
        gemm_dtype = cpu_gemm_dtype(engine.dtype, engine.device, engine.switches.cpu_prepack) or engine.dtype
        self.weight_dtype = engine.dtype if any(m.half_weight is not None for m in packed) else gemm_dtype
        self.attention_seconds = 0.0  # in the attention backends during the timed calls

    def make_reqs(self, batch_size: int, input_len: int, output_len: int) -> list[Req]:
        """Requests with random prompt ids, each holding a request row; greedy, EOS ignored, no logprobs."""
        params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True, logprobs=False)
        vocab = self.engine.vocab_size
        reqs = []
        for i in range(batch_size):
            req = Req(
                rid=str(i),
                prompt_ids=[self.rng.randrange(vocab) for _ in range(input_len)],
                params=params,
                seed=i,
                stop_token_ids=frozenset(),
                max_total_len=self.engine.context_len,
            )
            req.req_pool_idx = self.engine.kv_cache.allocate_rows(1)[0]
            reqs.append(req)
        return reqs

    def release(self, reqs: list[Req]) -> None:
        """Give back the request rows and KV slots the requests still hold (the scheduler has freed those it
        finished)."""
        for req in reqs:
            if req.req_pool_idx is None:
                continue
            self.engine.kv_cache.release(req.req_pool_idx, req.kv_len)
            req.req_pool_idx, req.kv_len = None, 0

    def run_round(self, batch: ScheduleBatch) -> tuple[torch.Tensor, SampleOutput]:
        """prepare → ForwardBatch.init_new → forward → sample; returns the logits and the sample."""
        engine = self.engine
        worker = batch.prepare(engine.kv_cache, engine.vocab_size, engine.device)
        logits = engine.runner.forward(ForwardBatch.init_new(worker, engine.runner))
        return logits.next_token_logits, engine.runner.sample(logits, worker.sampling_info)

    def _timed(self, fn: Callable[[], _Out]) -> tuple[float, _Out]:
        """``fn``'s wall time and result; its time in attention is added to :attr:`attention_seconds`."""
        with timing_attention(self.engine) as attention:
            _synchronize(self.engine.device)
            start = time.perf_counter()
            out = fn()
            _synchronize(self.engine.device)
            elapsed = time.perf_counter() - start
        self.attention_seconds += attention.seconds
        return elapsed, out

    def _round_bytes(self, kv_lens: list[int]) -> float:
        """Bytes a decode round over requests of ``kv_lens`` cached tokens reads (decode_bytes)."""
        return decode_bytes(self.engine.runner.model.config, self.engine.dtype, self.weight_dtype, kv_lens)

    def _decode_plain(self, reqs: list[Req], output_len: int) -> tuple[list[float], float]:
        """``output_len - 1`` DECODE rounds of the whole batch; their times and the bytes they read."""
        batch_size = len(reqs)
        decode_times: list[float] = []
        decode_bytes_total = 0.0
        for _ in range(output_len - 1):
            decode_bytes_total += self._round_bytes([r.kv_len for r in reqs])
            step = ScheduleBatch(ForwardMode.DECODE, reqs, [1] * batch_size, batch_size)
            elapsed, out = self._timed(lambda step=step: self.run_round(step)[1])  # type: ignore[misc]
            decode_times.append(elapsed)
            for req, token in zip(reqs, out.next_token_ids.tolist()):
                req.output_ids.append(token)
        return decode_times, decode_bytes_total

    def _decode_speculative(self, reqs: list[Req], output_len: int) -> tuple[list[float], float]:
        """The engine's rounds until every request has ``output_len`` tokens (the scheduler then frees it); their
        times and the bytes the target read (weights and the KV of each round's requests)."""
        scheduler = self.engine.scheduler
        scheduler.accept_histogram.clear()
        if output_len > 1:
            scheduler.running.extend(reqs)
        decode_times: list[float] = []
        decode_bytes_total = 0.0
        while scheduler.running:
            decode_bytes_total += self._round_bytes([r.kv_len for r in scheduler.running])
            elapsed, _ = self._timed(self.engine.step)
            decode_times.append(elapsed)
        return decode_times, decode_bytes_total

    def prefill(self, reqs: list[Req], prefix_len: int = 0) -> tuple[float, torch.Tensor, SampleOutput]:
        """An untimed EXTEND round of each prompt's first ``prefix_len`` tokens (none for 0), then the timed EXTEND
        round of the rest over that prefix (``extend_prefix_lens`` = ``prefix_len``), which samples each request's
        first token; its seconds, last-position logits (float ``[len(reqs), vocab]``) and sample."""
        if prefix_len:
            self.run_round(ScheduleBatch(ForwardMode.EXTEND, reqs, [prefix_len] * len(reqs)))
        # Built before timing: a ScheduleBatch notes at construction which rows sample.
        rest = ScheduleBatch(ForwardMode.EXTEND, reqs, [len(r.prompt_ids) - prefix_len for r in reqs])
        elapsed, (logits, out) = self._timed(lambda: self.run_round(rest))
        return elapsed, logits, out

    def run_case(
        self, batch_size: int, input_len: int, output_len: int, ceilings: Ceilings, prefix_len: int = 0
    ) -> OneBatchResult:
        """Prefill ``batch_size`` prompts of ``input_len`` tokens in one EXTEND round (after an untimed round of a
        ``prefix_len``-token prefix each: :meth:`prefill`), then decode."""
        config = self.engine.runner.model.config
        reqs = self.make_reqs(batch_size, prefix_len + input_len, output_len)
        try:
            self.attention_seconds = 0.0
            prefill_time, _, out = self.prefill(reqs, prefix_len)
            prefill_attention = self.attention_seconds
            for req, token in zip(reqs, out.next_token_ids.tolist()):
                req.output_ids.append(token)
            speculative = self.engine.scheduler.drafter is not None
            decode = self._decode_speculative if speculative else self._decode_plain
            decode_times, decode_bytes_total = decode(reqs, output_len)
        finally:
            self.release(reqs)
        total = prefill_time + sum(decode_times)
        median = decode_throughput = bandwidth = decode_attention = None
        if decode_times:
            steps = sum(decode_times)
            if not graphs_hide_attention(self.engine):
                decode_attention = (self.attention_seconds - prefill_attention) / steps
            median = statistics.median(decode_times)
            # A verify round emits a varying number of tokens: its throughput is all tokens over all rounds' time.
            decode_throughput = batch_size * (output_len - 1) / steps if speculative else batch_size / median
            bandwidth = decode_bytes_total / steps
        prefill_flops = forward_flops(config, [input_len] * batch_size, [prefix_len] * batch_size, batch_size)
        return OneBatchResult(
            batch_size=batch_size,
            prefix_len=prefix_len,
            input_len=input_len,
            output_len=output_len,
            prefill_latency=prefill_time,
            prefill_throughput=batch_size * input_len / prefill_time,
            first_decode_latencies=decode_times[:FIRST_DECODE_STEPS],
            median_decode_latency=median,
            decode_throughput=decode_throughput,
            total_latency=total,
            total_throughput=batch_size * (input_len + output_len) / total,
            decode_bandwidth_gbs=None if bandwidth is None else bandwidth / 1e9,
            prefill_tflops=prefill_flops / prefill_time / 1e12,
            matmul_ceiling_tflops=ceilings.matmul_flops / 1e12,
            copy_ceiling_gbs=ceilings.copy_bandwidth / 1e9,
            prefill_attention_share=prefill_attention / prefill_time,
            decode_attention_share=decode_attention,
            accept_histogram=dict(self.engine.scheduler.accept_histogram) if speculative else None,
        )

    def correctness_test(self, input_len: int) -> float:
        """Max |logit difference| between prefilling one prompt whole and in two chunks."""
        prompt = self.make_reqs(1, input_len, 1)
        self.release(prompt)
        logits = []
        for split in ([input_len], [input_len // 2, input_len - input_len // 2]):
            reqs = self.make_reqs(1, input_len, 1)
            reqs[0].prompt_ids = prompt[0].prompt_ids
            try:
                for n in split:
                    last, _ = self.run_round(ScheduleBatch(ForwardMode.EXTEND, reqs, [n]))
                logits.append(last[0].float().cpu())
            finally:
                self.release(reqs)
        return float((logits[0] - logits[1]).abs().max())
