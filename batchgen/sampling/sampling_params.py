"""Per-request sampling parameters, with the validation a user-facing batch tool needs."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from batchgen.errors import FieldError, shown_value
from batchgen.sampling.constraints import normalize_constraint
from batchgen.sampling.plain_values import whole_number

# Samples per prompt; the run's --max-running-requests may bound it further (all samples decode together).
MAX_SAMPLES = 1024


# The fields of a row's structured-output constraint, at most one of which a row gives.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "choice")
# The run defaults a model's generation_config.json may set (batchgen.loop.generation_config): those vLLM's
# ModelConfig.get_diff_sampling_param takes from it (its max_new_tokens is batchgen's own name).
MODEL_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
# Their flags' help: the default shown holds where the model's file gives none.
_OR_THE_MODELS = " (where the model's generation_config.json gives none: --generation-config)"


def constraint_option(name: str, value: Any) -> str | None:
    """``--json-schema``, ``--regex``, ``--ebnf`` or ``--choice`` as a flag, a config file or a keyword gives it:
    checked as a row's (:func:`batchgen.sampling.constraints.normalize_constraint`; a schema as an object or its JSON
    text).

    Raises:
        FieldError: as ``normalize_constraint``.
    """
    return None if value is None else normalize_constraint(name, value)


def _constraint_field(name: str, metavar: str, what: str) -> Any:
    """The declaration of constraint option ``name``: no constraint by default, read by :func:`constraint_option`."""
    parse: Callable[[Any], str | None] = functools.partial(constraint_option, name)
    return field(default=None, metadata={"help": f"Default per row: {what}.", "parse": parse, "metavar": metavar})


def prompt_logprobs_count(value: Any) -> int | None:
    """``prompt_logprobs`` as a row, a keyword, a config file or a flag gives it: ``true`` is 0 (the prompt's own
    logprobs, no other tokens), ``false`` and ``None`` are off (``None``), a count N (a float with no fraction too)
    is N; the range is :meth:`SamplingParams.validate`'s to check.

    Raises:
        FieldError: a value of another type.
    """
    if value is None or isinstance(value, bool):
        return 0 if value else None
    value = whole_number(value)
    if not isinstance(value, numbers.Integral):
        raise FieldError("prompt_logprobs", f"must be true, false or a count of top logprobs, got {shown_value(value)}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    Semantics follow vLLM/SGLang: ``temperature`` 0 means greedy; ``top_k`` -1 or 0 disables top-k;
    ``top_p`` 1.0 and ``min_p`` 0.0 disable those filters. ``stop`` strings are matched on the generated
    text only and are not included in the output text; ``stop_token_ids`` and the model's EOS ids end the
    request and are included in ``output_token_ids`` (in a constrained row only where its grammar is complete:
    they are its end tokens). ``min_new_tokens`` holds back every stop (EOS, stop ids
    and stop strings) until that many tokens exist. ``logprobs`` reports the chosen token's raw logprob
    (log_softmax of unprocessed logits, as vLLM's default and the OpenAI API); ``top_logprobs`` adds the N
    most likely tokens under the same distribution. ``n`` samples of one prompt are written as ``n`` rows
    with ``sample_index`` 0..n-1; sample 0 uses the row's seed, sample ``i`` a seed derived from (seed, i).
    """

    # Fields with a ``help`` are also ``batchgen run`` flags: the run's defaults for rows that do not set them.
    max_new_tokens: int = field(default=128, metadata={"help": f"Default per row{_OR_THE_MODELS}."})
    min_new_tokens: int = field(default=0, metadata={"help": "Default per row."})
    temperature: float = field(default=1.0, metadata={"help": f"Default per row{_OR_THE_MODELS}; 0 = greedy."})
    top_p: float = field(default=1.0, metadata={"help": f"Default per row{_OR_THE_MODELS}, in (0, 1]."})
    top_k: int = field(default=-1, metadata={"help": f"Default per row{_OR_THE_MODELS}; -1 or 0 = off."})
    min_p: float = field(default=0.0, metadata={"help": f"Default per row{_OR_THE_MODELS}, in [0, 1]."})
    # The command line applies --prompt-template's escapes ("escapes"): a shell passes "\n" as a backslash and an n.
    stop: tuple[str, ...] = field(
        default=(), metadata={"help": "Default stop string (repeat; \\n, \\t, \\\\ are escapes).", "escapes": True}
    )
    stop_token_ids: tuple[int, ...] = field(default=(), metadata={"help": "Default stop token id (repeat)."})
    # vLLM's: words the output may not contain (batchgen.sampling.bad_words).
    bad_words: tuple[str, ...] = field(default=(), metadata={"help": "Default word the output may not hold (repeat)."})
    ignore_eos: bool = field(default=False, metadata={"help": "Default per row."})
    seed: int | None = None
    skip_special_tokens: bool = field(default=True, metadata={"help": "Default per row."})
    include_stop_str_in_output: bool = field(
        default=False, metadata={"help": "Default per row: end text with the stop string that ended it (vLLM's)."}
    )
    logprobs: bool = field(default=True, metadata={"help": "Report each output token's raw logprob."})
    top_logprobs: int = field(default=0, metadata={"help": "Report the N most likely tokens."})
    repetition_penalty: float = field(default=1.0, metadata={"help": f"Default per row{_OR_THE_MODELS} (HF)."})
    frequency_penalty: float = field(default=0.0, metadata={"help": "Default per row, in [-2, 2]."})
    presence_penalty: float = field(default=0.0, metadata={"help": "Default per row, in [-2, 2]."})
    # (token id, bias) pairs; a tuple, not a dict, so the parameters stay hashable and immutable.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's: the only ids the row may produce (every other id's logit is -inf, EOS too unless listed); None: any.
    allowed_token_ids: tuple[int, ...] | None = None
    # At most one constraint (see batchgen.sampling.grammar); a JSON schema is kept as JSON text.
    json_schema: str | None = _constraint_field(
        "json_schema", "JSON", "a JSON schema the output follows (its JSON text; a row's own constraint replaces it)"
    )
    regex: str | None = _constraint_field("regex", "PATTERN", "a regular expression (Python's) the output matches")
    ebnf: str | None = _constraint_field("ebnf", "GRAMMAR", "an EBNF grammar (GBNF, root rule 'root') it follows")
    # vLLM's guided_choice, kept as the JSON text of the strings' list (as a schema is).
    choice: str | None = _constraint_field("choice", "JSON", "a JSON array of strings, one of which is the output")
    # None: off; N >= 0: report each prompt token's raw logprob (after the first) and the N most likely tokens.
    prompt_logprobs: int | None = field(
        default=None,
        metadata={
            "help": "Default per row: report prompt logprobs and the N most likely (true or 0: no others).",
            "parse": prompt_logprobs_count,
            "words": True,  # a flag's text true, false or N
            "metavar": "TRUE|FALSE|N",
        },
    )
    # The first prompt token whose logprob is reported (SGLang's logprob_start_len; None: token 1, the first that
    # has one); giving it asks for prompt logprobs. A row's ``continuation`` sets it to where the continuation starts.
    prompt_logprobs_from: int | None = None
    # vLLM's left truncation: only the prompt's last N tokens run (-1: the longest prompt the context takes).
    truncate_prompt_tokens: int | None = field(
        default=None, metadata={"help": "Default per row: keep only the prompt's last N tokens (-1: all that fit)."}
    )
    # Independent samples of the prompt: they share its prefill and prompt KV, each decodes on its own.
    n: int = field(default=1, metadata={"help": "Default per row: samples per prompt (one row each).", "flag": "--n"})
    # Run defaults only: the fields of MODEL_SAMPLING_FIELDS that no flag, config key or keyword set, which the
    # model's generation_config.json then sets (with_model_defaults); a row's parameters have none.
    left_to_model: tuple[str, ...] = ()

    def with_model_defaults(self, model: Mapping[str, Any]) -> SamplingParams:
        """These run defaults with the fields of :attr:`left_to_model` that ``model`` gives (the model's recommended
        values, :func:`batchgen.loop.generation_config.model_sampling_defaults`) set to its values, and none left:
        what the rows default to. A flag wins over the model, and a row's field over both, as in vLLM's
        ``--generation-config auto``."""
        taken = {name: model[name] for name in self.left_to_model if name in model}
        return dataclasses.replace(self, **taken, left_to_model=())

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(field name, source text) of the row's structured-output constraint, if any."""
        given = [(name, getattr(self, name)) for name in GRAMMAR_FIELDS]
        return next(((name, value) for name, value in given if value is not None), None)

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0, or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int | None) -> None:
        """Check every field against its allowed range; ``vocab_size`` ``None``: not known yet (no model loaded).

        Raises:
            FieldError: naming the first invalid field.
        """
        if not 1 <= self.n <= MAX_SAMPLES:
            raise FieldError("n", f"must be in [1, {MAX_SAMPLES}], got {self.n}")
        if self.max_new_tokens < 0:
            raise FieldError("max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise FieldError("min_new_tokens", f"must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise FieldError(
                "min_new_tokens",
                f"must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}",
            )
        # Upper bounds keep every value finite and non-zero in float32, where the sampler computes.
        if not math.isfinite(self.temperature) or not 0 <= self.temperature <= 1e4:
            raise FieldError("temperature", f"must be a number in [0, 10000], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise FieldError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise FieldError("top_k", f"must be -1 or 0 (off) or a positive count, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise FieldError("min_p", f"must be in [0, 1], got {self.min_p}")
        limit, end = (math.inf, "vocab size") if vocab_size is None else (vocab_size, str(vocab_size))
        size = "vocab size" if vocab_size is None else f"vocab size {vocab_size}"
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < limit:
                raise FieldError("stop_token_ids", f"id {token_id} is outside the vocabulary [0, {end})")
        if any(s == "" for s in self.stop):
            raise FieldError("stop", "stop strings must not be empty")
        if any(not word.strip() for word in self.bad_words):
            raise FieldError("bad_words", "a bad word must hold more than whitespace")
        if not 0 <= self.top_logprobs <= limit:
            raise FieldError("top_logprobs", f"must be in [0, {size}], got {self.top_logprobs}")
        if not 0.01 <= self.repetition_penalty <= 100.0:
            raise FieldError("repetition_penalty", f"must be in [0.01, 100], got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise FieldError(name, f"must be in [-2, 2], got {value}")
        for token_id, bias in self.logit_bias:
            if not 0 <= token_id < limit:
                raise FieldError("logit_bias", f"id {token_id} is outside the vocabulary [0, {end})")
            if not -100.0 <= bias <= 100.0:
                raise FieldError("logit_bias", f"bias of id {token_id} must be in [-100, 100], got {bias}")
        if self.truncate_prompt_tokens is not None and not (
            self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1
        ):
            raise FieldError("truncate_prompt_tokens", f"must be >= 1 or -1, got {self.truncate_prompt_tokens}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise FieldError("allowed_token_ids", "must not be empty (leave it out to allow every id)")
            for token_id in self.allowed_token_ids:
                if not 0 <= token_id < limit:
                    raise FieldError("allowed_token_ids", f"id {token_id} is outside the vocabulary [0, {end})")
        constraints = [n for n in GRAMMAR_FIELDS if getattr(self, n) is not None]
        if len(constraints) > 1:
            kinds = ", ".join(GRAMMAR_FIELDS)
            raise FieldError(constraints[1], f"give only one of {kinds} (found: {', '.join(constraints)})")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= limit:
            raise FieldError("prompt_logprobs", f"must be true, false or a count in [0, {size}]")
        if self.prompt_logprobs_from is not None and self.prompt_logprobs_from < 1:
            raise FieldError(
                "prompt_logprobs_from", f"must be >= 1 (token 0 has no logprob), got {self.prompt_logprobs_from}"
            )
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "needs logprobs: true")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            # vLLM's range (its OpenAI server's is int64's too): a negative seed is a seed like any other.
            raise FieldError("seed", f"must be a 64-bit signed integer, in [-2**63, 2**63), got {self.seed}")
