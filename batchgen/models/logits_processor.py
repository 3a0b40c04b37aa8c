"""Logits for the rows that sample, never for every token of a prefill; prompt logprobs block by block."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from batchgen.loop.forward_batch import ForwardBatch

# Prompt positions projected onto the vocabulary at once: bounds the [block, vocab] logits of a long prompt.
PROMPT_LOGPROB_BLOCK = 256

LMHead = Callable[[torch.Tensor], torch.Tensor]  # hidden states [rows, hidden_size] → logits [rows, vocab]


@dataclass
class LogitsProcessorOutput:
    """``next_token_logits``: float32 ``[num_sampled, vocab_size]``, one row per request that samples.

    ``prompt_logprobs`` float32 ``[m]``: raw logprob of each requested prompt token given what precedes it;
    ``prompt_is_argmax`` bool ``[m]``: whether that token is the argmax of its position's logits (the lowest id
    among ties, as ``torch.argmax`` and lm-eval's ``is_greedy``); ``prompt_top_ids`` int64 /
    ``prompt_top_logprobs`` float32 ``[m, k]``: the k most likely tokens there
    (``None`` when nothing was requested).
    """

    next_token_logits: torch.Tensor
    prompt_logprobs: torch.Tensor | None = None
    prompt_is_argmax: torch.Tensor | None = None
    prompt_top_ids: torch.Tensor | None = None
    prompt_top_logprobs: torch.Tensor | None = None


class LogitsProcessor:
    """Projects the hidden states of ``forward_batch.sample_indices`` onto the vocabulary.

    The projection runs in the model dtype and is then widened to float32, as transformers' ``generate`` does,
    so bf16 logits equal the reference's.
    """

    def __call__(self, hidden: torch.Tensor, lm_head: LMHead, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """``lm_head`` maps hidden states ``[rows, hidden_size]`` to logits ``[rows, vocab]`` in the model dtype."""
        out = LogitsProcessorOutput(self._logits(hidden, lm_head, forward_batch.sample_indices, forward_batch))
        if forward_batch.forward_mode.is_extend() and forward_batch.prompt_logprob_indices.numel():
            self._prompt_logprobs(hidden, lm_head, forward_batch, out)
        return out

    @staticmethod
    def _logits(hidden: torch.Tensor, lm_head: LMHead, rows: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        if not fb.forward_mode.is_decode():
            hidden = hidden.index_select(0, rows)
        return lm_head(hidden).float()

    def _prompt_logprobs(
        self, hidden: torch.Tensor, lm_head: LMHead, fb: ForwardBatch, out: LogitsProcessorOutput
    ) -> None:
        chosen, argmax, top_ids, top_values = [], [], [], []
        for start in range(0, fb.prompt_logprob_indices.numel(), PROMPT_LOGPROB_BLOCK):
            rows = fb.prompt_logprob_indices[start : start + PROMPT_LOGPROB_BLOCK]
            targets = fb.prompt_logprob_targets[start : start + PROMPT_LOGPROB_BLOCK]
            logprobs = torch.log_softmax(self._logits(hidden, lm_head, rows, fb), dim=-1)
            chosen.append(logprobs.gather(1, targets[:, None]).squeeze(1))
            argmax.append(logprobs.argmax(dim=-1) == targets)
            if fb.prompt_top_k:
                values, ids = logprobs.topk(fb.prompt_top_k, dim=-1)
                top_ids.append(ids)
                top_values.append(values)
        out.prompt_logprobs, out.prompt_is_argmax = torch.cat(chosen), torch.cat(argmax)
        if top_ids:
            out.prompt_top_ids, out.prompt_top_logprobs = torch.cat(top_ids), torch.cat(top_values)
