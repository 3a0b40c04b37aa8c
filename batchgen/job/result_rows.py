"""The output rows of finished requests and of bad input rows."""

from __future__ import annotations

import math
from typing import Any

from batchgen.errors import RowError
from batchgen.loop.req import Req
from batchgen.speculative.draft_state import spec_accept_length


def result_row(req: Req, passthrough: dict[str, Any]) -> dict[str, Any]:
    """The output row of a finished request (columns as in ``batchgen.io.writer.OUTPUT_COLUMNS``), then its input
    row's ``passthrough`` fields."""
    params = req.params
    scored = params.prompt_logprobs is not None
    return {
        "id": req.rid,
        "sample_index": req.sample_index,
        "text": req.text,
        "output_token_ids": req.output_ids,
        "output_logprobs": req.output_logprobs if params.logprobs else None,
        "top_logprobs": req.output_top_logprobs if params.logprobs and params.top_logprobs else None,
        "finish_reason": req.finish_reason,
        "matched_stop": req.matched_stop,
        "error": None,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "prompt_logprobs": req.prompt_logprobs if scored else None,
        "prompt_logprob_sum": math.fsum(req.prompt_logprobs) if scored else None,
        "prompt_is_greedy": all(req.prompt_argmax) if scored else None,
        "prompt_top_logprobs": req.prompt_top_logprobs if params.prompt_logprobs else None,
        "spec_accept_length": spec_accept_length(req),
        **passthrough,
    }


def error_row(error: RowError, rid: str, passthrough: dict[str, Any]) -> dict[str, Any]:
    """The output row written for a bad input row under ``--on-error skip``."""
    # A message quoting a lone surrogate (a key, a repr) keeps it as an escape: the column holds Unicode text.
    message = str(error).encode("utf-8", "backslashreplace").decode("utf-8")
    return {"id": rid, "finish_reason": "error", "error": message, **passthrough}
