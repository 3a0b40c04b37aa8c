"""``batchgen bench``: offline throughput of the engine on a workload, and of HF transformers on the same one."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from batchgen.bench.attention_time import attention_text, graphs_hide_attention, timing_attention
from batchgen.bench.model_costs import generation_flops
from batchgen.bench.probes import Ceilings, measure_ceilings
from batchgen.bench.workload import Workload
from batchgen.job.summary import prefix_cache_text
from batchgen.loop.engine import Engine, RoundStats, dtype_name
from batchgen.loop.req import Req
from batchgen.sampling.sampling_params import SamplingParams


@dataclass
class ThroughputResult:
    """Totals of one system on one workload; rates are per wall-clock second. ``prefix_cache_share``: the share
    of the prompt tokens admitted for prefill whose K/V the engine's prefix cache served (``None`` where there is
    no prefix cache: the cache turned off, or a baseline)."""

    system: str
    requests: int
    input_tokens: int
    output_tokens: int
    seconds: float
    prefix_cache_share: float | None = None

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.seconds

    def line(self) -> str:
        s = self.seconds
        return (
            f"{self.system:>16}: {self.requests / s:7.2f} req/s | input {self.input_tokens / s:8.1f} tok/s | "
            f"output {self.output_tokens / s:8.1f} tok/s | total {(self.input_tokens + self.output_tokens) / s:8.1f} "
            f"tok/s | {s:7.2f} s"
        ) + self._prefix_cache()

    def _prefix_cache(self) -> str:
        share = self.prefix_cache_share
        return "" if share is None else f" | {prefix_cache_text(share)}"

    def as_dict(self) -> dict[str, Any]:
        """The totals and the four rates the result line shows (SGLang's ``bench_offline_throughput`` names)."""
        s = self.seconds
        return {
            **asdict(self),
            "request_throughput": self.requests / s,
            "input_throughput": self.input_tokens / s,
            "output_throughput": self.output_throughput,
            "total_throughput": (self.input_tokens + self.output_tokens) / s,
        }


@dataclass(frozen=True)
class Roofline:
    """The workload's FLOPs (:func:`~batchgen.bench.model_costs.generation_flops`: linear layers, LM head and
    attention, without speculation's extra verify positions) at the machine's measured matmul rate (FLOP/s), and
    the share of batchgen's run spent in attention (:func:`run_engine_timing_attention`)."""

    flops: float
    matmul_rate: float
    output_tokens: int
    gemm_note: str = ""  # how the probed matmul ran, when not in the run's dtype
    attention_share: float | None = None

    @property
    def seconds(self) -> float:
        """The shortest time the workload can take at that rate."""
        return self.flops / self.matmul_rate

    def line(self, result: ThroughputResult) -> str:
        return (
            f"{'roofline':>16}: {self.flops / 1e12:.4g} TFLOP at the measured {self.matmul_rate / 1e12:.3f} TFLOP/s "
            f"matmul rate (the faster probe, before or after): {self.seconds:.3g} s, "
            f"at most {self.output_tokens / self.seconds:.1f} output tok/s; "
            f"{result.system} at {self.fraction(result):.0%} of it{self.gemm_note}; "
            f"{attention_text(self.attention_share)}"
        )

    def fraction(self, result: ThroughputResult) -> float:
        """Roofline time over the system's wall time."""
        return self.seconds / result.seconds


def measure_roofline(
    engine: Engine, workload: Workload, earlier: Ceilings | None = None, attention_share: float | None = None
) -> Roofline:
    """Probe the matmul rate in the engine's dtype on its device (:func:`measure_ceilings`), the higher of this
    probe and an ``earlier`` one (taken before the run: a shared machine's speed moves by 20 % within minutes, and
    the ceiling is the best it showed), and count the workload's FLOPs for the engine's model; ``attention_share``
    is the run's, as :func:`run_engine_timing_attention` measured it."""
    ceilings = measure_ceilings(engine.dtype, engine.device, engine.switches.cpu_prepack)
    if earlier is not None:
        ceilings = ceilings.highest(earlier)
    flops = generation_flops(engine.runner.model.config, [len(p) for p in workload.prompts], workload.output_len)
    note = "" if ceilings.gemm_dtype == engine.dtype else f"; the matmul ran as {dtype_name(ceilings.gemm_dtype)} GEMMs"
    return Roofline(flops, ceilings.matmul_flops, len(workload.prompts) * workload.output_len, note, attention_share)


def run_engine(engine: Engine, workload: Workload) -> ThroughputResult:
    """All prompts through the engine's scheduler loop (greedy, EOS ignored, no logprobs), timed end to end; with
    the engine's prefix cache on, the share of prompt tokens it served in this run (``engine.stats`` counts every
    run of the engine: this run's share is of the counts' growth)."""
    params = SamplingParams(max_new_tokens=workload.output_len, temperature=0.0, ignore_eos=True, logprobs=False)
    for i, prompt in enumerate(workload.prompts):
        engine.add(
            Req(
                rid=str(i),
                prompt_ids=list(prompt),
                params=params,
                seed=i,
                stop_token_ids=frozenset(),
                max_total_len=engine.context_len,
            )
        )
    before = (engine.stats.cached_tokens, engine.stats.admitted_prompt_tokens)
    start = time.perf_counter()
    finished = 0
    output_tokens = 0
    while engine.has_work():
        for req in engine.step():
            finished += 1
            output_tokens += len(req.output_ids)
    _synchronize(engine.device)
    seconds = time.perf_counter() - start
    run = RoundStats(
        cached_tokens=engine.stats.cached_tokens - before[0],
        admitted_prompt_tokens=engine.stats.admitted_prompt_tokens - before[1],
    )
    share = run.cached_share if engine.options.prefix_cache else None
    return ThroughputResult("batchgen", finished, workload.input_tokens, output_tokens, seconds, share)


def run_engine_timing_attention(engine: Engine, workload: Workload) -> tuple[ThroughputResult, float | None]:
    """:func:`run_engine` with the engine's attention backends timed (:func:`timing_attention`): its result and
    the share of its wall time spent in attention, ``None`` where CUDA graphs replay rounds
    (:func:`graphs_hide_attention`)."""
    with timing_attention(engine) as attention:
        result = run_engine(engine, workload)
    return result, None if graphs_hide_attention(engine) else attention.seconds / result.seconds


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_hf_model(engine: Engine) -> Any:
    """The same model in HF transformers, same dtype and device (random weights for ``random:`` presets).

    transformers' progress bars and notes are turned off (its errors still show): they would land between the
    benchmark's result lines.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # generate_batch logs through a logger of its own, outside transformers' logging tree.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)

    if engine.model_dir is None:
        # Initialised where it runs: random-initialising a 1B model on the host first takes longer than its run.
        with engine.device:
            model = AutoModelForCausalLM.from_config(engine.hf_config, dtype=engine.dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=engine.dtype)
    return model.to(engine.device).eval()


def run_hf_generate(model: Any, workload: Workload, batch_size: int, device: torch.device) -> ThroughputResult:
    """HF ``generate`` in static batches of ``batch_size``, left padding, greedy, exactly ``output_len`` new tokens."""
    n = workload.output_len
    start = time.perf_counter()
    output_tokens = 0
    with torch.inference_mode():
        for i in range(0, len(workload.prompts), batch_size):
            chunk = workload.prompts[i : i + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
            output_tokens += (out.shape[1] - width) * len(chunk)
    _synchronize(device)
    return ThroughputResult(
        "hf generate", len(workload.prompts), workload.input_tokens, output_tokens, time.perf_counter() - start
    )


def run_hf_generate_batch(model: Any, workload: Workload, device: torch.device) -> ThroughputResult:
    """HF transformers' continuous batching (``generate_batch``), greedy, ``output_len`` new tokens per prompt."""
    from transformers import GenerationConfig

    n = workload.output_len
    config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    # Not inference_mode: generate_batch fills its static tensors from a worker thread, outside that mode, and
    # in-place updates of inference tensors there fail (seen with transformers 5.17 on CUDA).
    with torch.no_grad():
        outputs = model.generate_batch(inputs=[list(p) for p in workload.prompts], generation_config=config)
    _synchronize(device)
    output_tokens = sum(len(o.generated_tokens) for o in outputs.values())
    return ThroughputResult(
        "hf generate_batch", len(outputs), workload.input_tokens, output_tokens, time.perf_counter() - start
    )
