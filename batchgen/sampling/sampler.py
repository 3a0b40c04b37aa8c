"""Choose the next token of every sampled row, and report raw logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.kernels.cpu.sampling_ops import argmax_rows, log_softmax_at
from batchgen.sampling.grammar import apply_bitmask
from batchgen.sampling.random import exponential_race, token_noise_keys
from batchgen.sampling.rejection import rejection_sample
from batchgen.sampling.sampling_batch_info import SamplingBatchInfo
from batchgen.sampling.top_logprobs import top_k_by_value_then_id


@dataclass
class SampleOutput:
    """The round's choices: ``next_token_ids`` int64 ``[n]``.

    ``logprobs`` float32 ``[n]`` is the chosen token's raw logprob (log_softmax of the unprocessed logits, as
    vLLM's default and the OpenAI API); ``top_ids`` int64 / ``top_logprobs`` float32 ``[n, k]`` the ``k`` most
    likely tokens under the same distribution (ranked by their logits, whose order the rounding of the logprobs
    could merge; equal logits by ascending id), ``k`` the largest count any row asked for. ``None`` when no row
    asked. ``probs`` float32 ``[n, vocab]``, with ``info.return_probs``: the normalised distribution each row
    drew from (one-hot at the argmax for greedy rows); else ``None``.
    """

    next_token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    probs: torch.Tensor | None = None


def sample(logits: torch.Tensor, info: SamplingBatchInfo, cpu_kernel: bool = True) -> SampleOutput:
    """Sample one token per row of float32 ``logits`` ``[n, vocab]``.

    Order: grammar mask → allowed ids, logit bias and penalties → banned tokens (min_new_tokens, bad words) →
    temperature → top-k → top-p → min-p → draw. Where the bans leave a row no token, they give way; where the
    allowed ids leave none the grammar takes, they give way to the grammar. The draw is an exponential race
    (:func:`exponential_race`, i.e. Gumbel-max) with counter-based noise per (seed, position, token id), so a row's
    token depends on its own seed, position and distribution only, and a rounding-sized change of its logits
    changes the token only where two tokens' noisy scores are that close (inverse-CDF sampling moved every interval
    by the rounding summed over the vocabulary). Greedy rows take the argmax of the adjusted logits (first index on
    ties, as ``torch.argmax``). Rows in ``info.drafts`` (sampled rows verifying a draft model's draft) emit
    :func:`rejection_sample`'s choice instead of their draw. Reported logprobs are raw (log_softmax of ``logits``),
    or with ``info.processed_logprobs`` those of the distribution actually sampled from (vLLM's processed mode).
    ``cpu_kernel``: the argmax and the race may run batchgen's C++ ops (:mod:`batchgen.kernels.cpu.sampling_ops`).
    """
    raw = logits
    if info.grammar_mask is not None:
        logits = apply_bitmask(logits, info.grammar_mask)
    constrained = logits
    if info.adjustments is not None:
        logits = info.adjustments.apply(logits)
    if info.banned_rows.numel():
        allowed = logits
        logits = logits.index_put(
            (info.banned_rows, info.banned_ids), torch.tensor(float("-inf"), device=logits.device)
        )
        # A grammar that can only end (with EOS) meets min_new_tokens banning EOS, or bad words ban every token it
        # or the allowed ids take: the bans give way, since a row with no token at all could only produce garbage.
        logits = torch.where(_no_token(logits), allowed, logits)
    if info.adjustments is not None and info.adjustments.allowed is not None:
        # Allowed ids that the grammar takes none of give way to it, likewise (found by a helper: token 0 came out).
        stuck = _no_token(logits)
        if bool(stuck.any()):
            logits = torch.where(stuck, info.adjustments.apply(constrained, limit=False), logits)
    next_ids = argmax_rows(logits, cpu_kernel)
    processed = torch.log_softmax(logits, dim=-1) if info.need_logprobs and info.processed_logprobs else None
    drawn_from = None
    if info.return_probs:
        drawn_from = torch.nn.functional.one_hot(next_ids, logits.shape[-1]).float()
    if not info.is_all_greedy:
        keep = processed is not None or drawn_from is not None or info.drafts is not None
        drawn, kept = _draw(logits, info, keep, cpu_kernel)
        if kept is not None:
            # The distribution drawn from, normalised by softmax, whose rows are computed one by one: a sum over
            # the vocabulary splits over threads otherwise for one row than for many, and a row's bits would depend
            # on its batch (--deterministic promises they do not).
            normalised = torch.softmax(kept, dim=-1)
            if info.drafts is not None:
                drawn = rejection_sample(drawn, normalised, info.seeds, info.steps, info.drafts, cpu_kernel)
            if processed is not None:
                processed = torch.where(info.greedy[:, None], processed, torch.log_softmax(kept, dim=-1))
            if drawn_from is not None:
                drawn_from = torch.where(info.greedy[:, None], drawn_from, normalised)
        next_ids = torch.where(info.greedy, next_ids, drawn)
    if processed is not None and info.argmax_only is not None:
        alone = torch.full_like(processed, float("-inf")).scatter_(1, next_ids[:, None], 0.0)
        processed = torch.where(info.argmax_only[:, None], alone, processed)
    logprobs = top_ids = top_logprobs = None
    if info.need_logprobs:
        k = max(info.top_logprobs)
        if processed is not None:
            logprobs = processed.gather(1, next_ids[:, None]).squeeze(1)
            if k:
                top_logprobs, top_ids = top_k_by_value_then_id(processed, k)
        else:
            # Raw logprobs at the ids read only (log_softmax keeps the logits' order), every row's by one formula
            # whether or not another row asks for a top list, so that its bits do not depend on its company.
            wanted = next_ids[:, None]
            if k:
                top_ids = top_k_by_value_then_id(raw, k)[1]
                wanted = torch.cat([wanted, top_ids], dim=1)
            values = log_softmax_at(raw, wanted, cpu_kernel)
            logprobs = values[:, 0]
            top_logprobs = values[:, 1:] if k else None
    return SampleOutput(next_ids, logprobs, top_ids, top_logprobs, drawn_from)


def _no_token(logits: torch.Tensor) -> torch.Tensor:
    """bool ``[n, 1]``: the rows of ``logits`` ``[n, vocab]`` that allow no token (all -inf)."""
    return torch.isinf(logits).all(dim=-1, keepdim=True)


def _draw(
    logits: torch.Tensor, info: SamplingBatchInfo, keep: bool, cpu_kernel: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample from the temperature-scaled, truncated distribution of every row (greedy rows included, unused).

    Returns the drawn ids and, with ``keep``, the temperature-scaled logits with -inf at every token of probability
    0 (truncated, or too unlikely for float32): the distribution drawn from is their softmax.
    """
    scaled = logits / info.temperatures[:, None]
    if info.need_top_k:
        kth = scaled.topk(int(info.top_ks.max()), dim=-1).values.gather(1, (info.top_ks - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if info.need_top_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p; the most likely token always stays. The mask goes
        # back to vocabulary order: every row draws in that order, so a row's token never depends on whether
        # another row of the batch uses top_p.
        drop = torch.empty_like(mass_before, dtype=torch.bool).scatter_(1, order, mass_before >= info.top_ps[:, None])
        # Only rows that ask: at top_p 1 the rounded running mass can reach 1 before the tail, which would drop a
        # row's last tokens only when another row of its batch uses top_p.
        drop &= (info.top_ps < 1.0)[:, None]
        probs = probs.masked_fill(drop, 0.0)
    if info.need_min_p:
        floor = probs.max(dim=-1, keepdim=True).values * info.min_ps[:, None]
        probs = probs.masked_fill(probs < floor, 0.0)
    picked = exponential_race(probs, token_noise_keys(info.seeds, info.steps), cpu_kernel)
    return picked, scaled.masked_fill(probs == 0.0, float("-inf")) if keep else None
