"""What a round's forward and sample write into its requests: prompt logprobs, and the tokens each one emits."""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchgen.loop.req import Req
from batchgen.loop.schedule_batch import ScheduleBatch
from batchgen.loop.stop_checker import append_token
from batchgen.models.logits_processor import LogitsProcessorOutput
from batchgen.sampling.sampler import SampleOutput


@dataclass
class RoundTokens:
    """A round's draws as host lists, one entry per draw: token ids, their logprobs and top (id, logprob) lists
    (``None`` when no row asked for them)."""

    ids: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None

    @staticmethod
    def from_sample(result: SampleOutput) -> RoundTokens:
        """Copy ``result``'s tensors to the host (this waits for the device)."""
        return RoundTokens(
            result.next_token_ids.tolist(),
            result.logprobs.tolist() if result.logprobs is not None else None,
            result.top_ids.tolist() if result.top_ids is not None else None,
            result.top_logprobs.tolist() if result.top_logprobs is not None else None,
        )

    def emit(self, req: Req, first: int, count: int) -> int:
        """Append draws ``first..first + count - 1`` (``count`` >= 1) to ``req`` until one finishes it; return how
        many were appended (not the draw the row's grammar refused, which ends it: ``append_token``)."""
        before = len(req.output_ids)
        want_logprobs = req.params.logprobs
        k = req.params.top_logprobs if want_logprobs else 0
        for j in range(first, first + count):
            top = (
                _possible(self.top_ids[j][:k], self.top_logprobs[j][:k])
                if k and self.top_ids and self.top_logprobs
                else None
            )
            append_token(req, self.ids[j], self.logprobs[j] if want_logprobs and self.logprobs else None, top)
            if req.finished:
                break
        return len(req.output_ids) - before


def record_prompt_logprobs(batch: ScheduleBatch, out: LogitsProcessorOutput) -> None:
    """Hand each row its slice of the round's prompt logprobs (rows in ``batch.prompt_logprob_rows`` order)."""
    assert out.prompt_logprobs is not None
    assert out.prompt_is_argmax is not None
    values, argmax = out.prompt_logprobs.tolist(), out.prompt_is_argmax.tolist()
    top_ids = out.prompt_top_ids.tolist() if out.prompt_top_ids is not None else None
    top_values = out.prompt_top_logprobs.tolist() if out.prompt_top_logprobs is not None else None
    start = 0
    for row, count in batch.prompt_logprob_rows:
        req = batch.reqs[row]
        req.prompt_logprobs.extend(values[start : start + count])
        req.prompt_argmax.extend(argmax[start : start + count])
        k = req.params.prompt_logprobs or 0
        if k and top_ids is not None and top_values is not None:
            req.prompt_top_logprobs.extend(
                _possible(ids[:k], lps[:k])
                for ids, lps in zip(top_ids[start : start + count], top_values[start : start + count])
            )
        start += count


def _possible(ids: list[int], logprobs: list[float]) -> list[tuple[int, float]]:
    """A step's top (id, logprob) pairs without those of probability 0: under ``--logprobs-mode processed``,
    tokens that top-k, top-p, min-p or a grammar ruled out (-inf, which JSON cannot carry) rank last in an
    arbitrary order and are no likely tokens at all."""
    return [(i, lp) for i, lp in zip(ids, logprobs) if lp != -math.inf]
