"""lm-eval's requests as batchgen rows: the truncation rules of lm-eval's Hugging Face backend (``HFLM`` in
``lm_eval/models/huggingface.py``, lm-evaluation-harness 0.4), restated on token ids, and its generation arguments
as sampling fields."""

from __future__ import annotations

import logging
from typing import Any

from lm_eval.models.utils import handle_stop_sequences, maybe_truncate, normalize_gen_kwargs
from lm_eval.utils import warning_once

from batchgen.sampling.row_fields import SAMPLING_FIELDS

logger = logging.getLogger(__name__)

# Generation arguments batchgen sets itself from lm-eval's own (max_gen_toks, until, do_sample), or that make no
# sense for one lm-eval request (several samples, prompt scoring).
SET_BY_REQUESTS = frozenset(("max_new_tokens", "stop", "n", "prompt_logprobs", "prompt_logprobs_from"))


def scoring_row(context_ids: list[int], continuation_ids: list[int], max_length: int, name: str) -> dict[str, Any]:
    """The row that scores ``continuation_ids`` after ``context_ids``, under HF's left truncation.

    HF reads the last ``max_length + 1`` tokens of context + continuation and scores the continuation's tokens among
    them, each from the position before it (the last token is only a target: the model reads ``max_length``). The
    row is that window, its logprobs reported from the continuation's first token in it. HF asserts that the
    continuation is at most ``max_length`` tokens; a longer one here has only its last ``max_length`` tokens
    scored (every token of the window but the first), with a warning naming ``name``.

    Args:
        context_ids, continuation_ids: token ids as lm-eval's ``TemplateLM`` splits the request (``_encode_pair``;
            the prefix token for an empty context); ``continuation_ids`` not empty.
        max_length: the most tokens the model reads (lm-eval's ``max_length``).
        name: the request, as a warning names it.

    Returns:
        ``{"prompt_token_ids", "prompt_logprobs_from", "max_new_tokens": 0}``: the row's
        ``prompt_logprob_sum`` and ``prompt_is_greedy`` are lm-eval's ``(logprob, is_greedy)``.
    """
    window = (context_ids + continuation_ids)[-(max_length + 1) :]
    scored = min(len(continuation_ids), len(window) - 1)
    if scored < len(continuation_ids):
        logger.warning(
            "%s: continuation of %d tokens > max_length %d: only its last %d tokens are scored",
            name,
            len(continuation_ids),
            max_length,
            scored,
        )
    return {"prompt_token_ids": window, "prompt_logprobs_from": len(window) - scored, "max_new_tokens": 0}


def generation_row(
    context_ids: list[int], gen_kwargs: dict[str, Any], eos: str, max_length: int, max_gen_toks: int, name: str
) -> tuple[dict[str, Any], list[str]]:
    """The row that generates for an lm-eval ``generate_until`` request, and its stop strings (lm-eval's
    ``until``, EOS's text added, as HF adds it).

    ``max_gen_toks`` (and its aliases ``max_new_tokens``...: lm-eval's ``normalize_gen_kwargs``) is the row's
    ``max_new_tokens``, ``until`` its ``stop``. Greedy (``temperature`` 0) unless ``do_sample`` is true and the
    temperature above 0, as HF; ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and every
    other argument named as a batchgen sampling field are passed on; the others are ignored, with a warning (once
    per set of names).
    The context is left-truncated to ``max_length - max_gen_toks`` tokens, as HF truncates it; where that leaves no
    room (``max_gen_toks >= max_length``, which HF asserts against), lm-eval's ``maybe_truncate`` with
    ``shrink_gen_toks`` decides: fewer tokens generated, the context kept or cut to ``max_length - 1`` tokens.

    Args:
        context_ids: the request's context, tokenized as HF does.
        gen_kwargs: the request's generation arguments.
        eos: the text of the end-of-text token.
        max_length, max_gen_toks: lm-eval's ``max_length`` and its default for ``max_gen_toks``.
        name: the request, as a warning names it.
    """
    kwargs = dict(normalize_gen_kwargs(gen_kwargs, max_gen_toks))
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
    new_tokens = kwargs.pop("max_gen_toks")
    if new_tokens < max_length:
        context_ids = context_ids[-(max_length - new_tokens) :]
    else:
        logger.warning("%s: max_gen_toks %d >= max_length %d: shrunk to fit", name, new_tokens, max_length)
        context_ids, new_tokens = maybe_truncate(context_ids, new_tokens, max_length, shrink_gen_toks=True)
    sampling = {key: value for key, value in kwargs.items() if key in SAMPLING_FIELDS and key not in SET_BY_REQUESTS}
    ignored = sorted(set(kwargs) - set(sampling) - {"do_sample"})
    if ignored:
        warning_once(logger, "generation arguments %s are no batchgen sampling fields: ignored", ", ".join(ignored))
    if not kwargs.get("do_sample"):
        sampling["temperature"] = 0.0
    row = {
        "prompt_token_ids": context_ids,
        "max_new_tokens": new_tokens,
        "stop": [s for s in until if s],
        "logprobs": False,
        **sampling,
    }
    return row, until
