"""The top-k logprobs of each row, in a fixed order: by value, equal values by token id."""

from __future__ import annotations

import torch

# Candidates taken beyond k, so that equal values at the cut can be ordered by id without sorting the whole row.
_TIE_WINDOW = 8


def top_k_by_value_then_id(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of each row of ``values`` ``[n, V]`` (float), largest first, equal values by
    ascending id: ``(top [n, k], ids int64 [n, k])``.

    ``torch.topk`` leaves the order of equal values unspecified, and in bfloat16 two tokens' logits are often
    exactly equal: a greedy row, which takes the lowest such id (``torch.argmax``), would then see another token
    head its own top list. Rows whose run of equal values reaches past the window of ``k + 8`` candidates are
    sorted whole (stable), so the choice of ids at the cut is exact too.
    """
    vocab = values.shape[-1]
    window = min(vocab, k + _TIE_WINDOW)
    top, ids = values.topk(window, dim=-1)
    # Ascending ids, then a stable sort by value: equal values end up in id order.
    by_id = ids.argsort(dim=-1)
    top, ids = top.gather(1, by_id), ids.gather(1, by_id)
    by_value = top.argsort(dim=-1, descending=True, stable=True)
    top, ids = top.gather(1, by_value), ids.gather(1, by_value)
    if window < vocab:
        cut_in_a_tie = (top[:, k - 1] == top[:, -1]).nonzero().flatten()
        if cut_in_a_tie.numel():
            whole, order = values[cut_in_a_tie].sort(dim=-1, descending=True, stable=True)
            top[cut_in_a_tie, :k], ids[cut_in_a_tie, :k] = whole[:, :k], order[:, :k]
    return top[:, :k], ids[:, :k]
