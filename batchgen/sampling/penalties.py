"""Logit bias and repetition / frequency / presence penalties, applied sparsely to the rows that use them.

Semantics:
- ``repetition_penalty`` (HF ``RepetitionPenaltyLogitsProcessor``; Keskar et al. 2019, CTRL): for every token seen in
  the prompt or the output, a positive logit is divided by the penalty and a negative one multiplied.
- ``frequency_penalty`` / ``presence_penalty`` (OpenAI API, vLLM): over output tokens only,
  ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
- ``logit_bias`` (OpenAI API): ``logit += bias`` for the listed token ids.
- ``allowed_token_ids`` (vLLM): every other id's logit is ``-inf``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from batchgen.sampling.sampling_params import SamplingParams


@dataclass
class TokenHistory:
    """The token counts penalties need, updated once per generated token (never recounted)."""

    prompt_tokens: frozenset[int]
    output_counts: Counter[int] = field(default_factory=Counter)

    def add(self, token_id: int) -> None:
        self.output_counts[token_id] += 1


def needs_history(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


@dataclass
class LogitAdjustments:
    """Per-round sparse (row, token) index tensors (int64) and values (float32) of every adjustment, and the rows
    (int64 ``[m]``) whose ids are limited with their allowed ids (bool ``[m, vocab]``)."""

    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    additive: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    repetition: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        histories: Sequence[TokenHistory | None],
        device: torch.device,
        vocab_size: int,
    ) -> LogitAdjustments | None:
        """Collect the adjustments of rows that have any; ``None`` when no row has one (the common case)."""
        limited = [row for row, p in enumerate(params) if p.allowed_token_ids is not None]
        allowed = None
        if limited:
            mask = torch.zeros(len(limited), vocab_size, dtype=torch.bool)
            for i, row in enumerate(limited):
                mask[i, list(params[row].allowed_token_ids or ())] = True
            allowed = (torch.tensor(limited, dtype=torch.int64, device=device), mask.to(device))
        bias: list[tuple[int, int, float]] = []
        additive: list[tuple[int, int, float]] = []
        repetition: list[tuple[int, int, float]] = []
        for row, (p, history) in enumerate(zip(params, histories)):
            bias += [(row, token, value) for token, value in p.logit_bias]
            if history is None:
                continue
            if p.frequency_penalty or p.presence_penalty:
                additive += [
                    (row, token, p.frequency_penalty * count + p.presence_penalty)
                    for token, count in history.output_counts.items()
                ]
            if p.repetition_penalty != 1.0:
                seen = history.prompt_tokens | history.output_counts.keys()
                repetition += [(row, token, p.repetition_penalty) for token in seen]
        if not (bias or additive or repetition or limited):
            return None

        def tensors(entries: list[tuple[int, int, float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
            if not entries:
                return None
            rows, tokens, values = zip(*entries)
            return (
                torch.tensor(rows, dtype=torch.int64, device=device),
                torch.tensor(tokens, dtype=torch.int64, device=device),
                torch.tensor(values, dtype=torch.float32, device=device),
            )

        return cls(tensors(bias), tensors(additive), tensors(repetition), allowed)

    def apply(self, logits: torch.Tensor, limit: bool = True) -> torch.Tensor:
        """The adjusted copy of float32 ``logits`` ``[n, vocab]``: the allowed ids (unless not ``limit``), bias, then
        repetition, then frequency/presence."""
        logits = logits.clone()
        if self.allowed is not None and limit:
            rows, mask = self.allowed
            logits[rows] = logits[rows].masked_fill(~mask, float("-inf"))
        if self.bias is not None:
            rows, tokens, values = self.bias
            logits.index_put_((rows, tokens), values, accumulate=True)
        if self.repetition is not None:
            rows, tokens, penalty = self.repetition
            picked = logits[rows, tokens]
            logits[rows, tokens] = torch.where(picked > 0, picked / penalty, picked * penalty)
        if self.additive is not None:
            rows, tokens, delta = self.additive
            logits.index_put_((rows, tokens), -delta, accumulate=True)
        return logits
