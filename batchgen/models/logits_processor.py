"""Logits for the rows that sample, never for every token of a prefill."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

if TYPE_CHECKING:
    from batchgen.loop.forward_batch import ForwardBatch


@dataclass
class LogitsProcessorOutput:
    """``next_token_logits``: float32 ``[num_sampled, vocab_size]``, one row per request that samples."""

    next_token_logits: torch.Tensor


class LogitsProcessor:
    """Projects the hidden states of ``forward_batch.sample_indices`` onto the vocabulary.

    The projection runs in the model dtype and is then widened to float32, as transformers' ``generate`` does,
    so bf16 logits equal the reference's.
    """

    def __call__(
        self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, forward_batch: ForwardBatch
    ) -> LogitsProcessorOutput:
        if not forward_batch.forward_mode.is_decode():
            hidden = hidden.index_select(0, forward_batch.sample_indices)
        return LogitsProcessorOutput(F.linear(hidden, lm_head_weight).float())
