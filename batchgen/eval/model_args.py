"""``--model_args`` of ``--model batchgen``: the keys other lm-eval backends take that batchgen reads as they are
meant or leaves aside, their checks, and errors named by the keys a user wrote."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import Any

from batchgen.api.options import option_names
from batchgen.errors import BatchgenError, FieldError
from batchgen.eval.requests import SET_BY_REQUESTS
from batchgen.io.input_options import chat_template_kwargs
from batchgen.job.options import JobOptions
from batchgen.loop.options import EngineOptions
from batchgen.sampling.row_fields import SAMPLING_FIELD_ALIASES, SAMPLING_FIELDS
from batchgen.sampling.sampling_params import GRAMMAR_FIELDS

logger = logging.getLogger(__name__)

# lm-eval's vLLM backend seeds its sampling with 1234 unless told otherwise, and its HF backend draws from the torch
# seed lm-eval's --seed sets (1234 by default): a sampled task repeats across runs with either.
DEFAULT_SEED = 1234
# Keys of --model hf and --model vllm that change nothing here: batchgen runs no code from the model's repository,
# loads the model's own tokenizer (its fast one), and picks its attention kernels and device placement itself
# (revision main and the model as its own tokenizer too, below).
_LEFT_ASIDE = ("trust_remote_code", "use_fast_tokenizer", "attn_implementation", "parallelize")
# Parallelism keys: one engine on one device is all a value of 1 asks for.
_PARALLEL = ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size")
# A batchgen flag as an error message names it (--max-running-requests), a word of its own (not inside a path).
_FLAG = re.compile(r"(?<![\w/.-])--([a-z0-9]+(?:-[a-z0-9]+)*)(?![\w-])")


def other_backends_args(pretrained: str, options: dict[str, Any]) -> None:
    """Take out of ``options`` the keys of other backends' ``--model_args`` that batchgen honours by doing nothing
    (``trust_remote_code=True``, ``tensor_parallel_size=1``, ``tokenizer`` naming the model itself), each with a
    warning (a log line) where it asked for something (``trust_remote_code=True``, ``parallelize=True``).

    Raises:
        BatchgenError: ``tokenizer`` naming another tokenizer than the model's, a ``revision`` but ``main``; a
            parallelism key above 1.
    """
    for name in _LEFT_ASIDE:
        if name in options and options.pop(name) not in (None, False):
            logger.warning("--model_args %s: not used by batchgen (the model's own files and kernels)", name)
    revision = options.pop("revision", None)
    if revision not in (None, "main"):
        raise BatchgenError(f"--model_args revision: batchgen loads the model's files as they are, got {revision!r}")
    tokenizer = options.pop("tokenizer", None)
    if tokenizer is not None and os.path.normpath(str(tokenizer)) != os.path.normpath(str(pretrained)):
        raise BatchgenError(f"--model_args tokenizer: batchgen uses the model's own tokenizer, got {tokenizer!r}")
    for name in _PARALLEL:
        value = model_args_count(name, options.pop(name, None))
        if value is not None and value > 1:
            raise BatchgenError(
                f"--model_args {name}: batchgen runs one engine on one device, got {value} (more machines: "
                "docs/scale-out.md)"
            )


def refuse_sampling_args(options: dict[str, Any]) -> None:
    """Refuse a sampling field among ``options`` (``temperature``, vLLM's ``max_tokens``...; not ``seed``, the
    engine's run seed here): lm-eval samples as each task's ``gen_kwargs`` say, and a model arg of that name would
    otherwise be refused as a keyword of ``batchgen.Generator``, pointing a user of lm-eval at a Python method.

    Raises:
        BatchgenError: naming the key and where lm-eval takes it instead.
    """
    sampling = (set(SAMPLING_FIELDS) | set(SAMPLING_FIELD_ALIASES)) - option_names(EngineOptions, JobOptions)
    name = next((name for name in options if name in sampling), None)
    if name is None:
        return
    meant = SAMPLING_FIELD_ALIASES.get(name, name)
    if meant == "max_new_tokens":
        where = "lm-eval's is the max_gen_toks model arg (default 256) or a task's (--gen_kwargs max_gen_toks=N)"
    elif meant == "stop":
        where = "lm-eval's is a task's until"
    elif name in GRAMMAR_FIELDS:
        where = "lm-eval's requests carry no structured-output constraint"
    elif meant in SET_BY_REQUESTS:  # n, prompt logprobs
        where = "lm-eval's requests set it themselves (samples: a task's repeats; prompt logprobs: loglikelihood)"
    else:  # generation_row passes it on
        where = (
            f"lm-eval takes it from each task's gen_kwargs, or --gen_kwargs {meant}=VALUE for every generate_until task"
        )
    raise BatchgenError(f"--model_args {name}: a sampling option; {where}")


def model_args_count(name: str, value: Any, least: int = 1) -> int | None:
    """A ``--model_args`` integer, checked (lm-eval hands ``8`` on as 8, ``-5`` as -5.0, ``abc`` as text); ``None``
    stays ``None``.

    Raises:
        BatchgenError: ``--model_args NAME: must be an integer >= LEAST, got ...``.
    """
    if value is None:
        return None
    number = None
    if isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, int | str) and not isinstance(value, bool):
        with contextlib.suppress(ValueError):  # text that is no number
            number = int(value)
    if number is None or number < least:
        shown = repr(value) if number is None else number  # as typed: lm-eval's command line turns -5 into -5.0
        raise BatchgenError(f"--model_args {name}: must be an integer >= {least}, got {shown}")
    return number


def as_model_args_error(error: BatchgenError) -> BatchgenError:
    """``error`` of a ``batchgen.Generator`` option as ``--model_args`` names it: each of batchgen's flags by its
    key (``--seed: must be an integer`` → ``--model_args seed: must be an integer``; lm-eval has a ``--seed`` of its
    own, which is not that one); unchanged where it names none (a model that cannot be loaded)."""
    known = option_names(EngineOptions, JobOptions)

    def key(match: re.Match[str]) -> str:
        name = match.group(1).replace("-", "_")
        return name if name in known else match.group(0)

    message = _FLAG.sub(key, str(error))
    if message == str(error):  # no option named (a model that cannot be loaded)
        return error
    return BatchgenError(f"--model_args {message}")


def chat_template_args(options: dict[str, Any]) -> dict[str, Any]:
    """Take out of ``options`` the chat template's arguments lm-eval's HF and vLLM backends take:
    ``chat_template_args`` (an object), and ``enable_thinking`` (Qwen3's switch) over it.

    Raises:
        BatchgenError: ``chat_template_args`` that is no object of template arguments.
    """
    try:
        arguments = chat_template_kwargs(options.pop("chat_template_args", None)) or {}
    except FieldError as e:
        raise BatchgenError(f"--model_args chat_template_args: {e.message}") from None
    if "enable_thinking" in options:
        arguments["enable_thinking"] = options.pop("enable_thinking")
    return arguments
