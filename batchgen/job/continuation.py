"""Where a scored continuation's tokens begin: lm-evaluation-harness's rule for splitting context and continuation."""

from __future__ import annotations

from collections.abc import Callable


def split_continuation(
    encode: Callable[[str], list[int]], context: str, continuation: str, prefix_token_id: int | None
) -> tuple[list[int], list[int]]:
    """The token ids of ``context`` and of ``continuation`` scored after it, as lm-eval's Hugging Face backend
    splits them (``HFLM._encode_pair`` in lm-evaluation-harness 0.4).

    Whitespace ending the context moves to the start of the continuation (``"Q: ... A: "`` + ``"Paris"`` becomes
    ``"Q: ... A:"`` + ``" Paris"``), since tokenizers attach a space to the word after it. The continuation's
    tokens are then those of ``encode(context + continuation)`` after as many tokens as ``encode(context)`` has,
    and the context's tokens are ``encode(context)``'s own. Where a tokenizer merges characters across the boundary
    (the two strings' last and first characters become one token in the whole), the continuation's first token is
    that merged token, and its context stays ``encode(context)``: the same ids lm-eval's backends score.

    Args:
        encode: text → token ids, with whatever special tokens the caller's prompts get.
        context: the text the continuation is conditioned on; may be empty.
        continuation: the text scored.
        prefix_token_id: the context's one token when ``context`` is empty (lm-eval gives BOS, else EOS); ``None``
            to split an empty context by the rule above (right where ``encode`` adds a BOS of its own).

    Returns:
        (context ids, continuation ids); their concatenation is what the model reads.
    """
    if not context and prefix_token_id is not None:
        ids = encode(continuation)
        # A continuation that itself starts with the prefix token is conditioned on that token (lm-eval 0.4.13).
        return (ids[:1], ids[1:]) if ids[:1] == [prefix_token_id] else ([prefix_token_id], ids)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = encode(context)
    return context_ids, encode(context + continuation)[len(context_ids) :]
