"""A row's sampling fields as JSON (or Python) gives them: their names (batchgen's and other APIs' aliases), their
types checked and converted, and the :class:`~batchgen.sampling.sampling_params.SamplingParams` they make over the
run's defaults."""

from __future__ import annotations

import math
import numbers
from dataclasses import fields
from typing import Any

from batchgen.errors import NOT_UNICODE, FieldError, is_unicode_text, shown_value
from batchgen.sampling.constraints import normalize_constraint
from batchgen.sampling.plain_values import whole_number
from batchgen.sampling.sampling_params import GRAMMAR_FIELDS, SamplingParams, prompt_logprobs_count

# Fields that an input row may set at top level to override the CLI defaults for that row.
SAMPLING_FIELDS: tuple[str, ...] = (
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "bad_words",
    "ignore_eos",
    "seed",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "logprobs",
    "top_logprobs",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "allowed_token_ids",
    "json_schema",
    "regex",
    "ebnf",
    "choice",
    "prompt_logprobs",
    "prompt_logprobs_from",
    "truncate_prompt_tokens",
    "n",
)

# OpenAI's and vLLM's names for sampling fields, which input rows may use (options take only batchgen's names); a
# row gives a field under at most one of its names (MAX_NEW_TOKENS_NAMES for max_new_tokens).
SAMPLING_FIELD_ALIASES: dict[str, str] = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
}
# Sampling fields that are no run option (no flag: token biases, where prompt logprobs start) but that a Python call
# may still give every row, as SGLang's sampling_params dict does; not the seed, which Generator() takes for the run.
ROW_FIELD_KEYWORDS = ("logit_bias", "allowed_token_ids", "prompt_logprobs_from")


def field_names(field: str) -> tuple[str, ...]:
    """Sampling field ``field``'s name and then its aliases (:data:`SAMPLING_FIELD_ALIASES`)."""
    return (field, *[alias for alias, name in SAMPLING_FIELD_ALIASES.items() if name == field])


MAX_NEW_TOKENS_NAMES: tuple[str, ...] = field_names("max_new_tokens")


def switch_hint(name: str) -> str:
    """What to add to the message of a switch given a non-bool value: for ``logprobs``, which is a count in vLLM,
    what gives vLLM's count here; nothing for the other switches."""
    return " (vLLM's logprobs=N is logprobs true with top_logprobs N)" if name == "logprobs" else ""


_INT_FIELDS = {"max_new_tokens", "min_new_tokens", "top_k", "top_logprobs", "n"}
_FLOAT_FIELDS = {"temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"}
_BOOL_FIELDS = {"ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "logprobs"}


def _coerce(name: str, value: Any) -> Any:
    """Check the JSON type of one sampling field and convert it to the dataclass's type."""
    if name in _INT_FIELDS:
        value = whole_number(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise FieldError(name, f"must be an integer, got {shown_value(value)}")
        return value
    if name in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numbers.Real: numpy's long double too
            raise FieldError(name, f"must be a number, got {shown_value(value)}")
        return float(value)
    if name in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise FieldError(name, f"must be true or false, got {shown_value(value)}{switch_hint(name)}")
        return value
    if name in ("seed", "prompt_logprobs_from", "truncate_prompt_tokens"):
        value = whole_number(value)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise FieldError(name, f"must be an integer or null, got {shown_value(value)}")
        return value
    if name in ("stop", "bad_words"):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
            raise FieldError(name, f"must be a string or a list of strings, got {shown_value(value)}")
        if not all(is_unicode_text(s) for s in value):  # it could never match the detokenized text
            raise FieldError(name, NOT_UNICODE)
        return tuple(value)
    if name in ("stop_token_ids", "allowed_token_ids"):
        if isinstance(value, (list, tuple)):
            value = [whole_number(t) for t in value]
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise FieldError(name, f"must be a list of integers, got {shown_value(value)}")
        return tuple(value) if name == "stop_token_ids" else tuple(sorted(set(value)))
    if name == "logit_bias":
        return _coerce_logit_bias(value)
    if name == "prompt_logprobs":
        return prompt_logprobs_count(value)
    if name in GRAMMAR_FIELDS:
        return normalize_constraint(name, value)
    raise FieldError(name, "is not a sampling field")


def _coerce_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """``{"id": bias}`` (JSON object keys are strings; a Python dict's may be integers, as vLLM's and HF's take
    them) → sorted ``((id, bias), ...)``."""
    if not isinstance(value, dict):
        raise FieldError("logit_bias", f"must be an object of token id → bias, got {shown_value(value)}")
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        is_int = isinstance(key, numbers.Integral) and not isinstance(key, bool) and int(key) >= 0  # numpy's too
        if not (is_int or (isinstance(key, str) and key.isascii() and key.isdigit())):
            raise FieldError("logit_bias", f"key {key!r} is not a token id")
        token_id = int(key)
        if token_id in pairs:
            raise FieldError("logit_bias", f"token id {token_id} is given twice")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise FieldError("logit_bias", f"bias of id {token_id} must be a finite number, got {bias!r}")
        pairs[token_id] = float(bias)
    return tuple(sorted(pairs.items()))


def make_sampling_params(defaults: SamplingParams, overrides: dict[str, Any], vocab_size: int) -> SamplingParams:
    """Return ``defaults`` with the row's ``overrides`` applied, type-checked and validated.

    ``None`` values in ``overrides`` mean "use the default" (Parquet fills absent fields with nulls). A field may
    be given under an alias of :data:`SAMPLING_FIELD_ALIASES` (``max_tokens``); errors then name the alias.

    Raises:
        FieldError: naming the first field with a wrong type or an out-of-range value, or the second of a field's
            names (:func:`field_names`) when the row gives two.
    """
    given = [name for name in overrides if overrides[name] is not None]
    for name in dict.fromkeys(SAMPLING_FIELD_ALIASES.values()):
        names = field_names(name)
        twice = [n for n in names if n in given]
        if len(twice) > 1:
            raise FieldError(twice[1], f"give only one of {', '.join(names)} (found: {', '.join(twice)})")
    aliased = {SAMPLING_FIELD_ALIASES[name]: name for name in given if name in SAMPLING_FIELD_ALIASES}
    values = {f.name: getattr(defaults, f.name) for f in fields(defaults)}
    if any(overrides.get(name) is not None for name in GRAMMAR_FIELDS):
        values.update(dict.fromkeys(GRAMMAR_FIELDS))  # a row's own constraint replaces the run's
    try:
        for name, value in overrides.items():
            if value is None and name != "seed":
                continue
            field = SAMPLING_FIELD_ALIASES.get(name, name)
            values[field] = _coerce(field, value)
        if values["prompt_logprobs_from"] is not None and values["prompt_logprobs"] is None:
            if overrides.get("prompt_logprobs") is False:
                message = "asks for prompt logprobs, which prompt_logprobs: false turns off"
                raise FieldError("prompt_logprobs_from", message)
            values["prompt_logprobs"] = 0
        params = SamplingParams(**values)
        params.validate(vocab_size)
    except FieldError as e:
        if e.field in aliased:
            raise FieldError(aliased[e.field], e.message) from None
        raise
    return params
