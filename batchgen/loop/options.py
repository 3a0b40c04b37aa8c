"""Engine options: everything ``batchgen run`` and the benchmarks pass down to the loop.

Each field is declared once here: its default, its help text (``metadata["help"]``; ``metadata["flag"]`` where the
flag is not ``--field-name``) and, in :meth:`EngineOptions.validate`, its rules. :mod:`batchgen.cli.options` turns
the declarations into the commands' flags and ``--config`` keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from batchgen.errors import BatchgenError, FieldError, shown_value
from batchgen.kernels.attention import ATTENTION_BACKENDS, deterministic_backend
from batchgen.models.resolve import DEFAULT_MODEL

DTYPE_NAMES = ("float32", "bfloat16", "float16")
# Other names of those dtypes that vLLM's --dtype and torch take.
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
SPECULATIVE_ALGORITHMS = ("ngram", "draft")
SPECULATIVE_ACCEPTANCES = ("rejection", "coupled")
LOGPROBS_MODES = ("raw", "processed")
# --generation-config's words; any other value is a directory holding this file.
GENERATION_CONFIG_WORDS = ("auto", "none")
GENERATION_CONFIG_FILE = "generation_config.json"
# Other spellings and engines' words for those: vLLM's --generation-config vllm, SGLang's --sampling-defaults.
_GENERATION_CONFIG_MEANT = {
    **{word: f" (did you mean '{word}'?)" for word in GENERATION_CONFIG_WORDS},
    "vllm": " (vLLM's 'vllm', its own defaults, is batchgen's 'none')",
    "openai": " (SGLang's 'openai', the API's defaults, is batchgen's 'none')",
    "model": " (SGLang's 'model' is batchgen's 'auto')",
}


def dtype_option(value: Any) -> str:
    """``--dtype`` as a flag, a config file or a keyword gives it: a name, vLLM's ``half`` and ``float`` read as
    ``float16`` and ``float32``, a ``torch.dtype`` as its name (HF's ``torch_dtype=torch.bfloat16``); whether the
    name is known is :meth:`EngineOptions.validate`'s to say.

    Raises:
        FieldError: neither a string nor a ``torch.dtype``.
    """
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    if not isinstance(value, str):
        raise FieldError("dtype", f"must be a dtype's name, got {shown_value(value)}")
    return _DTYPE_ALIASES.get(value, value)


def pick_device(name: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU.

    Raises:
        BatchgenError: not a device name, or CUDA asked for but not available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = torch.device("meta")
    if device.type not in ("cpu", "cuda"):
        raise BatchgenError(f"--device {name}: expected auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BatchgenError(f"--device {name}: CUDA is not available on this machine")
    return device


@dataclass(frozen=True)
class EngineOptions:
    """How to load the model and size the loop; each field's meaning is its ``help``."""

    model: str = field(
        default=DEFAULT_MODEL,
        metadata={"help": "Model directory, .gguf file, built-in name, Hugging Face hub id or random:PRESET."},
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "auto (the checkpoint's; float32 when it names none, or names float16 on CPU), float32, "
            "bfloat16 or float16 (half and float are float16 and float32).",
            "parse": dtype_option,
        },
    )
    device: str = field(default="auto", metadata={"help": "auto (CUDA if available), cpu, cuda or cuda:N."})
    context_length: int | None = field(
        default=None, metadata={"help": "Longest prompt + output (default: the model's)."}
    )
    max_total_tokens: int | None = field(
        default=None, metadata={"help": "KV pool size in tokens (default: from --mem-fraction)."}
    )
    mem_fraction: float = field(
        default=0.4, metadata={"help": "Share of the memory free after loading the weights given to the KV pool."}
    )
    chunked_prefill_size: int = field(
        default=2048, metadata={"help": "Longest prefill chunk per round; 0 = no chunking."}
    )
    max_prefill_tokens: int = field(default=8192, metadata={"help": "Prompt tokens per round."})
    # 128 on CPU: decode rounds are memory-bound there (weights and K/V), so wider rounds read the weights fewer
    # times; 256 gained nothing more on W3 (docs/performance.md).
    max_running_requests: int | None = field(
        default=None, metadata={"help": "Requests decoding together (default: 128 on CPU, 256 on GPU)."}
    )
    prefix_cache: bool = field(
        default=True,
        metadata={
            "help": "Keep computed prompt and output K/V in a radix tree and reuse it for every later prompt that "
            "starts with the same tokens (off: same outputs, every prompt prefilled whole).",
            "flag": "--prefix-cache/--no-prefix-cache",
        },
    )
    attention_backend: str = field(default="auto", metadata={"help": f"One of {', '.join(ATTENTION_BACKENDS)}."})
    enable_mixed_chunk: bool = field(
        default=True,
        metadata={
            "help": "Run prefill chunks and decodes in one forward.",
            "flag": "--enable-mixed-chunk/--disable-mixed-chunk",
        },
    )
    disable_cuda_graph: bool = field(
        default=False,
        metadata={
            "help": "Run decode rounds eagerly at their own size.",
            "flag": "--disable-cuda-graph/--enable-cuda-graph",
        },
    )
    # The graph runner captures sizes 1, 2, 4, 8, 16, 24, ... up to it (capped by max_running_requests).
    cuda_graph_max_bs: int | None = field(
        default=None,
        metadata={
            "help": "Largest decode batch replayed from a CUDA graph (default 256; on CPU: off, N pads eagerly)."
        },
    )
    speculative_algorithm: str | None = field(
        default=None,
        metadata={
            "help": "Speculative decoding: ngram (drafts from the sequence's own earlier text) or draft (a draft "
            "model proposes); default off."
        },
    )
    # Verify rounds score K + 1 positions.
    speculative_num_draft_tokens: int = field(default=4, metadata={"help": "Draft tokens per request per round (K)."})
    speculative_ngram_min: int = field(default=2, metadata={"help": "Shortest suffix the n-gram drafter looks up."})
    speculative_ngram_max: int = field(default=4, metadata={"help": "Longest suffix the n-gram drafter looks up."})
    # The draft runs on --device in the target's dtype.
    speculative_draft_model: str | None = field(
        default=None,
        metadata={
            "help": "Draft model of --speculative-algorithm draft (same vocabulary as --model; or random:PRESET)."
        },
    )
    speculative_acceptance: str = field(
        default="rejection",
        metadata={
            "help": "How sampled rows verify a draft model's drafts: rejection (rejection sampling, most accepted) "
            "or coupled (outputs identical to plain decoding with the same seeds)."
        },
    )
    # None: the engine decides, by deterministic_by_default (on only where it was measured to cost nothing).
    deterministic: bool | None = field(
        default=None,
        metadata={
            "help": "Bitwise batch invariance (CPU, or CUDA with the triton backend): a row's logits, hence its "
            "tokens, logprobs and text, do not depend on the rows it runs with, its prompt's chunking or the prefix "
            "cache (docs/input-output.md). Default: on with the CPU attention kernel on CPUs with AVX-512 or "
            "AVX2 and no AMX, where it costs nothing; off elsewhere.",
            "flag": "--deterministic/--no-deterministic",
        },
    )
    seed: int | None = field(
        default=None, metadata={"help": "Run seed: rows without a seed get one derived from it and their id."}
    )
    logprobs_mode: str = field(
        default="raw",
        metadata={
            "help": "raw: log_softmax of the model's logits; processed: of the distribution sampled from (after "
            "bias, penalties, temperature and truncation)."
        },
    )
    generation_config: str = field(
        default="auto",
        metadata={
            "help": "Where the sampling defaults that no flag, config key or keyword sets come from: auto: the "
            "model's generation_config.json (its temperature, top_p, top_k, min_p, repetition_penalty and "
            "max_new_tokens, as vLLM and SGLang take them); none: batchgen's own; or a directory holding a "
            "generation_config.json. A row's own fields still win.",
        },
    )

    def validate(self, here: bool = True) -> None:
        """Every rule of these options that needs no model; with ``here``, the device's too (that it exists on this
        machine): ``False`` where the engine runs elsewhere (``--ray``: its replicas check it where they load).

        Raises:
            BatchgenError: one line naming the first bad flag and its value.
        """
        for name in ("max_running_requests", "max_prefill_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise BatchgenError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.chunked_prefill_size < 0:
            raise BatchgenError(f"--chunked-prefill-size must be >= 0, got {self.chunked_prefill_size}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise BatchgenError(f"--seed must be a 64-bit signed integer, in [-2**63, 2**63), got {self.seed}")
        for name in ("context_length", "max_total_tokens"):  # a prompt token and the one it predicts
            value = getattr(self, name)
            if value is not None and value < 2:
                raise BatchgenError(f"--{name.replace('_', '-')} must be >= 2, got {value}")
        if not 0.0 < self.mem_fraction < 1.0:
            raise BatchgenError(f"--mem-fraction must be in (0, 1), got {self.mem_fraction}")
        self._validate_speculative()
        if here:
            pick_device(self.device)
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise BatchgenError(f"unknown --dtype '{self.dtype}'; choose auto, {', '.join(DTYPE_NAMES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise BatchgenError(
                f"unknown attention backend '{self.attention_backend}'; choose one of {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise BatchgenError(f"--logprobs-mode must be raw or processed, got '{self.logprobs_mode}'")
        if self.deterministic and here:
            deterministic_backend(self.attention_backend, pick_device(self.device))
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise BatchgenError(f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")
        self._validate_generation_config(here)

    def _validate_generation_config(self, here: bool) -> None:
        """``--generation-config``: one of its words, or a directory holding the file; with ``here`` false (the
        replicas' machines read it), any text but another engine's word or an empty one.

        Raises:
            BatchgenError: naming the value, with the word meant where it is another engine's.
        """
        value = self.generation_config
        meant = _GENERATION_CONFIG_MEANT.get(value.lower(), "")
        if value in GENERATION_CONFIG_WORDS or (value and (Path(value) / GENERATION_CONFIG_FILE).is_file()):
            return
        if value and not meant and not here:
            return
        problem = f"holds no {GENERATION_CONFIG_FILE}" if value and Path(value).is_dir() else "is no directory"
        raise BatchgenError(
            f"--generation-config must be auto, none or a directory holding a {GENERATION_CONFIG_FILE}; "
            f"'{value}' {problem}{meant}"
        )

    def _validate_speculative(self) -> None:
        """The speculative options' rules: a known algorithm and acceptance rule, at least 1 draft token, a
        non-empty n-gram range, a draft model exactly with ``draft``."""
        algorithm = self.speculative_algorithm
        if algorithm is not None and algorithm not in SPECULATIVE_ALGORITHMS:
            raise BatchgenError(
                f"--speculative-algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}, got '{algorithm}'"
            )
        if algorithm != "draft" and self.speculative_draft_model is not None:
            raise BatchgenError("--speculative-draft-model needs --speculative-algorithm draft")
        # The other values are checked with speculation off too: a bad value is a mistake whether or not it is used.
        if self.speculative_acceptance not in SPECULATIVE_ACCEPTANCES:
            raise BatchgenError(
                f"--speculative-acceptance must be one of {', '.join(SPECULATIVE_ACCEPTANCES)}, "
                f"got '{self.speculative_acceptance}'"
            )
        if self.speculative_num_draft_tokens < 1:
            raise BatchgenError(f"--speculative-num-draft-tokens must be >= 1, got {self.speculative_num_draft_tokens}")
        low, high = self.speculative_ngram_min, self.speculative_ngram_max
        if not 1 <= low <= high:
            raise BatchgenError(f"--speculative-ngram-min/max must satisfy 1 <= min <= max, got {low} and {high}")
        if algorithm == "draft" and not self.speculative_draft_model:
            raise BatchgenError("--speculative-algorithm draft needs --speculative-draft-model PATH")
