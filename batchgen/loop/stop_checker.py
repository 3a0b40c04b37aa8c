"""Append a sampled token to a request and decide whether it is finished (stop ids, stop strings, length)."""

from __future__ import annotations

from typing import Any

from batchgen.loop.detokenizer import continuation_text, find_stop
from batchgen.loop.req import Req


def append_token(req: Req, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None) -> None:
    """Record one sampled token and set ``req.finish_reason`` when it ends the request.

    Follows the OpenAI/vLLM conventions: a stop or EOS token stays in ``output_token_ids``; no stop counts
    before ``min_new_tokens`` tokens exist; ``length`` when ``max_new_tokens`` is reached or prompt + output
    fill the context, or (``token_id`` not appended) where a constrained row's grammar refuses the token, which it
    takes only where it allowed none. Stop strings are looked for in the text as it streams (see
    :func:`finalize_text` for the final cut).
    """
    num_out = len(req.output_ids) + 1
    stops_allowed = num_out >= req.params.min_new_tokens
    if req.grammar is not None and not req.grammar.accept(token_id, may_end=stops_allowed):
        # The grammar allowed no token here (every one masked: a JSON string's pattern of control characters
        # alone, which JSON must escape), so the draw had none to take: the row ends, incomplete, as if cut by its
        # length, not filled with a token the grammar refuses (found by a helper: id 0 to max_new_tokens).
        req.finish_reason = "length"
        return
    req.output_ids.append(token_id)
    if req.history is not None:
        req.history.add(token_id)
    if logprob is not None:
        req.output_logprobs.append(logprob)
    if top is not None:
        req.output_top_logprobs.append(top)
    if req.grammar is not None and req.grammar.terminated:
        # A constrained row ends where its grammar does, on one of its end ids (an EOS under ignore_eos or
        # min_new_tokens too): that token is the stop, and its text is no more part of ``text`` than any other stop
        # token's. A stop id the grammar took as text does not end it (grammar.GrammarState.accept).
        req.finish_reason, req.matched_stop = "stop", str(token_id)
    elif req.grammar is None and stops_allowed and token_id in req.stop_token_ids:
        req.finish_reason, req.matched_stop = "stop", str(token_id)
    elif req.detokenizer is not None:
        committed_before = req.detokenizer.committed_tokens
        new_text = req.detokenizer.update([token_id])
        hit = find_stop(req.detokenizer.text, len(new_text), req.params.stop) if stops_allowed and new_text else None
        if hit is not None:
            req.finish_reason, req.matched_stop = "stop", hit[1]
            req.stop_search_from = committed_before
            req.text = req.detokenizer.text[: _text_end(req, hit)]
    if req.finish_reason is None and (num_out >= req.params.max_new_tokens or req.fill_len >= req.max_total_len):
        req.finish_reason = "length"


def finalize_text(req: Req, tokenizer: Any) -> None:
    """Set ``req.text`` of a finished request: the continuation text without the stop that ended it (a stop string
    kept where ``include_stop_str_in_output`` asks).

    The text is cut from the full decode (``decode(prompt + output)`` minus ``decode(prompt)``), never from the
    streamed text, which can differ where a decoder rewrites a run of invalid bytes. A stop token's text is left
    out, as a stop string is (vLLM's default); the token itself stays in ``output_token_ids``. Without a
    tokenizer (``random:`` models) there is no text.
    """
    if tokenizer is None:
        return
    skip = req.params.skip_special_tokens
    if req.matched_stop is not None and req.stop_search_from is None:  # a stop or EOS token
        req.text = continuation_text(tokenizer, req.prompt_ids, req.output_ids[:-1], skip)
        return
    full = continuation_text(tokenizer, req.prompt_ids, req.output_ids, skip)
    if req.stop_search_from is None:
        req.text = full
        return
    # Look for the stop where the streaming check found it: in the text of the tokens committed last.
    start = len(continuation_text(tokenizer, req.prompt_ids, req.output_ids[: req.stop_search_from], skip))
    hit = find_stop(full, len(full) - start, req.params.stop)
    if hit is not None:
        req.text = full[: _text_end(req, hit)]


def _text_end(req: Req, hit: tuple[int, str]) -> int:
    """Where ``text`` ends for a stop string found at ``hit`` (its index, the string): before it, or after it with
    ``include_stop_str_in_output`` (vLLM's option; the rest of the token that completed it is left out either way)."""
    return hit[0] + len(hit[1]) if req.params.include_stop_str_in_output else hit[0]
