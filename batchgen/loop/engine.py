"""``Engine``: loads the model once and runs rounds (schedule → forward → sample → process) on request."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from batchgen.environment import kernel_switches
from batchgen.kernels.attention import deterministic_by_default
from batchgen.kernels.switches import KernelSwitches
from batchgen.loop.cpu_malloc import keep_freed_memory
from batchgen.loop.drafter import Drafter
from batchgen.loop.forward_batch import ForwardBatch
from batchgen.loop.generation_config import eos_token_ids, sampling_defaults
from batchgen.loop.kv_cache import KVCache
from batchgen.loop.kv_pool import KVSlotAllocator, TokenToKVPool
from batchgen.loop.model_runner import ModelRunner
from batchgen.loop.options import DTYPE_NAMES, EngineOptions, pick_device
from batchgen.loop.radix_cache import RadixCache
from batchgen.loop.req import Req
from batchgen.loop.schedule_batch import ScheduleBatch
from batchgen.loop.scheduler import Scheduler, SchedulerOptions
from batchgen.models.config import context_limit
from batchgen.models.source import ModelSource

# Makes the drafter ``EngineOptions`` asks for (``None``: plain decoding) for the target's runner and its graph
# runner's largest batch: ``batchgen.speculative.make_drafter``, passed in by whoever builds the engine.
DrafterFactory = Callable[[EngineOptions, ModelRunner, int], Drafter | None]

_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass
class RoundStats:
    """Token counts of all rounds so far, for progress and the summary.

    ``prefill_tokens`` were computed (recomputes after a preemption too). Of the requests admitted (for the first
    time: not a retracted one coming back), ``admitted_prompt_tokens`` is their prompt tokens and
    ``cached_tokens`` those whose K/V the prefix cache gave them. Counts add and subtract field by field (a Ray
    replica reports a batch's as after − before; the driver sums them)."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    rounds: int = 0
    cached_tokens: int = 0
    admitted_prompt_tokens: int = 0

    def __add__(self, other: RoundStats) -> RoundStats:
        return RoundStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: RoundStats) -> RoundStats:
        return RoundStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    @property
    def cached_share(self) -> float | None:
        """Share of the admitted prompt tokens that the prefix cache served, ``None`` before any."""
        total = self.admitted_prompt_tokens
        return self.cached_tokens / total if total else None


@dataclass(frozen=True)
class EngineFacts:
    """What a job records of an engine and builds requests with, apart from running it; picklable, so a driver
    learns them from an engine loaded elsewhere (a Ray replica: ``batchgen.job.ray_replica``).

    Attributes:
        model_dir: the model's directory (``None`` for ``random:`` models).
        dtype: what it computes in.
        kernel_switches: its kernel switches as the output's metadata records them (``KernelSwitches.as_metadata``).
        deterministic: whether ``--deterministic`` holds.
        tokenizer: the Hugging Face tokenizer (``None`` for ``random:`` models).
        vocab_size: logits per position.
        context_len: the most tokens a row may hold (prompt and output).
        model_context_len: the most the model itself holds (what ``--context-length`` defaults to).
        max_running_requests: the most requests decoding together.
        eos_token_ids: the ids that end a row.
        sampling_defaults: the sampling defaults ``--generation-config`` reads (the ``temperature``, ``top_p``... a
            model's generation_config.json recommends: ``batchgen.loop.generation_config.sampling_defaults``),
            for the run defaults that no flag sets (:meth:`SamplingParams.with_model_defaults`).
        sampling_defaults_file: the file they came from; ``None`` where it gave none.
    """

    model_dir: Path | None
    dtype: torch.dtype
    kernel_switches: dict[str, bool | None]
    deterministic: bool
    tokenizer: Any
    vocab_size: int
    context_len: int
    model_context_len: int
    max_running_requests: int
    eos_token_ids: list[int]
    sampling_defaults: dict[str, Any]
    sampling_defaults_file: str | None


def pick_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    """Resolve ``--dtype``; ``auto`` is the checkpoint's dtype, float32 if it names none or names float16 on CPU.

    Raises:
        KeyError: an unknown dtype name (:meth:`EngineOptions.validate` names it first).
    """
    if name == "auto":
        declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        dtype = declared if isinstance(declared, torch.dtype) else _DTYPES.get(str(declared), torch.float32)
        return torch.float32 if device.type == "cpu" and dtype == torch.float16 else dtype
    return _DTYPES[name]  # a known name: EngineOptions.validate checked it


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``: the spelling of ``--dtype``."""
    return str(dtype).removeprefix("torch.")


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


class Engine:
    """The model, its KV pools and a scheduler, ready to run rounds.

    ``tokenizer`` is ``None`` for ``random:`` models: they take ``prompt_token_ids`` only and produce no text.
    ``make_drafter`` makes the drafter of speculative decoding (``batchgen.speculative.make_drafter``); it is
    needed when ``options.speculative_algorithm`` is set. ``switches``: the kernel switches; ``None`` reads them
    from the environment, here, once for this engine.

    Raises (from the constructor):
        BatchgenError: the model cannot be resolved or loaded, or the options do not fit it.
        ValueError: speculative options without ``make_drafter``.
    """

    def __init__(
        self,
        options: EngineOptions,
        make_drafter: DrafterFactory | None = None,
        switches: KernelSwitches | None = None,
    ) -> None:
        self.options = options
        # Option errors first: they need no model, and loading one can take a while.
        options.validate()
        if options.speculative_algorithm is not None and make_drafter is None:
            raise ValueError("speculative options need make_drafter (batchgen.speculative.make_drafter)")
        self.switches = switches if switches is not None else kernel_switches()
        source = ModelSource.open(options.model)
        self.model_dir: Path | None = source.model_dir
        self.tokenizer: Any = source.tokenizer
        self.hf_config = source.hf_config
        self.eos_token_ids = eos_token_ids(self.model_dir, self.hf_config)
        self.sampling_defaults, self.sampling_defaults_file = sampling_defaults(
            options.generation_config, self.model_dir
        )
        self.device = pick_device(options.device)
        self.switches = self.switches.as_run_on(self.device.type)
        self.dtype = pick_dtype(options.dtype, self.hf_config, self.device)
        self.deterministic = (
            options.deterministic
            if options.deterministic is not None
            else deterministic_by_default(options.attention_backend, self.device, self.switches)
        )
        if self.device.type == "cpu":
            keep_freed_memory()
        self.max_running_requests: int = options.max_running_requests or (128 if self.device.type == "cpu" else 256)
        context_len, note = context_limit(self.hf_config, options.context_length)
        if note is not None:
            print(f"batchgen: {note}", file=sys.stderr)
        model = source.load(
            self.dtype, self.device, context_len, self.switches, self.deterministic, options.attention_backend
        )
        config = model.config
        per_token = TokenToKVPool.bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, self.dtype)
        pool_size = options.max_total_tokens or int(options.mem_fraction * _available_memory(self.device) / per_token)
        pool_size = min(pool_size, self.max_running_requests * context_len)
        if pool_size < context_len:
            # One request must always fit alone, or preemption could not guarantee progress.
            print(
                f"batchgen: KV pool of {pool_size} tokens < context length; context length set to {pool_size}",
                file=sys.stderr,
            )
            context_len = pool_size
        self.context_len = context_len
        self.runner = ModelRunner(
            model,
            self.device,
            self.dtype,
            pool_size,
            self.max_running_requests,
            context_len,
            options.attention_backend,
            cuda_graph_max_bs=self._graph_max_bs(options),
            verify_tokens=options.speculative_num_draft_tokens + 1 if options.speculative_algorithm else 0,
            switches=self.switches,
            deterministic=self.deterministic,
        )
        allocator = KVSlotAllocator(pool_size)
        radix_cache = RadixCache(allocator) if options.prefix_cache else None
        self.kv_cache = KVCache(self.runner.req_to_token_pool, allocator, radix_cache)
        self.scheduler = Scheduler(
            SchedulerOptions(
                max_running_requests=self.max_running_requests,
                max_prefill_tokens=options.max_prefill_tokens,
                chunked_prefill_size=options.chunked_prefill_size,
                enable_mixed_chunk=options.enable_mixed_chunk,
            ),
            self.kv_cache,
            self.tokenizer,
            drafter=make_drafter(options, self.runner, self._graph_max_bs(options)) if make_drafter else None,
            # Graphs have fixed shapes: every request then verifies exactly K drafts (padded when fewer).
            pad_drafts=self.runner.graph_runner is not None,
        )
        self.stats = RoundStats()

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def facts(self) -> EngineFacts:
        """This engine's :class:`EngineFacts`."""
        return EngineFacts(
            self.model_dir,
            self.dtype,
            self.switches.as_metadata(self.device.type),
            self.deterministic,
            self.tokenizer,
            self.vocab_size,
            self.context_len,
            context_limit(self.hf_config, None)[0],
            self.max_running_requests,
            self.eos_token_ids,
            self.sampling_defaults,
            self.sampling_defaults_file,
        )

    def add(self, req: Req) -> None:
        self.scheduler.add(req)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def drop_all(self) -> None:
        """Drop every request added and not finished (a Python caller stopped reading its results)."""
        self.scheduler.drop_all()

    def _graph_max_bs(self, options: EngineOptions) -> int:
        """The graph runner's largest batch, 0 for none (see ``EngineOptions.cuda_graph_max_bs``)."""
        if options.disable_cuda_graph:
            return 0
        if options.cuda_graph_max_bs is not None:
            return options.cuda_graph_max_bs
        return 256 if self.device.type == "cuda" else 0

    def step(self) -> list[Req]:
        """Run one round; return the requests that finished in it."""
        batch = self.scheduler.next_batch()
        if batch is None:
            if self.scheduler.has_work():  # a scheduling fault: fail loudly rather than spin forever
                raise RuntimeError(self.scheduler.stuck_message())
            return []
        started = time.perf_counter()
        worker_batch = batch.prepare(
            self.kv_cache,
            self.vocab_size,
            self.device,
            processed_logprobs=self.options.logprobs_mode == "processed",
        )
        forward_batch = ForwardBatch.init_new(worker_batch, self.runner)
        logits_output = self.runner.forward(forward_batch)
        sample_output = self.runner.sample(logits_output, worker_batch.sampling_info)
        self.stats.rounds += 1
        verify = batch.forward_mode.is_target_verify()
        # A verify round emits a varying number of tokens per request: count them around process_result.
        outputs_before = sum(len(r.output_ids) for r in batch.reqs) if verify else 0
        finished = self.scheduler.process_result(batch, sample_output, logits_output)
        self._observe_round_cost(batch, started)
        if verify:
            self.stats.decode_tokens += sum(len(r.output_ids) for r in batch.reqs) - outputs_before
        else:
            self.stats.decode_tokens += batch.num_decode_rows
            self.stats.prefill_tokens += sum(batch.extend_lens) - batch.num_decode_rows
        self.stats.cached_tokens += batch.cached_tokens
        self.stats.admitted_prompt_tokens += batch.admitted_prompt_tokens
        return finished

    def _observe_round_cost(self, batch: ScheduleBatch, started: float) -> None:
        """Feed the scheduler's draft budget with this DECODE/TARGET_VERIFY round's width and duration (after
        ``process_result``, whose host copies wait for the device)."""
        mode = batch.forward_mode
        if self.scheduler.drafter is not None and (mode.is_decode() or mode.is_target_verify()):
            self.scheduler.round_cost.observe(sum(batch.extend_lens), time.perf_counter() - started)
