"""Per-round sampling parameters of every sampled row, as tensors (built once per round)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchgen.sampling.grammar import GrammarState, grammar_bitmask
from batchgen.sampling.penalties import LogitAdjustments, TokenHistory
from batchgen.sampling.rejection import DraftProposals
from batchgen.sampling.sampling_params import SamplingParams

# Below this temperature a row is sampled greedily: dividing logits by it would overflow to inf (vLLM uses the
# same threshold), and the distribution is one-hot to float precision anyway.
GREEDY_TEMPERATURE = 1e-5


def samples_greedily(params: SamplingParams) -> bool:
    """Whether a row with ``params`` takes the argmax instead of drawing."""
    return params.is_greedy or params.temperature < GREEDY_TEMPERATURE


@dataclass
class SamplingBatchInfo:
    """Sampling inputs for ``n`` rows.

    Attributes:
        temperatures, top_ps, min_ps: float32 ``[n]``; top_ks: int64 ``[n]`` (vocab size where top-k is off).
        greedy: bool ``[n]``; is_all_greedy: host bool, lets the sampler skip everything but argmax.
        seeds, steps: int64 ``[n]``: each row's seed and output position, from which its noise is derived.
        banned_rows, banned_ids: int64 ``[m]`` pairs (row, token) masked to -inf before choosing a token
            (EOS and stop ids while ``min_new_tokens`` is not reached, the next token of a bad word).
        top_logprobs: host list, how many top logprobs each row reports; need_logprobs: any row wants them.
        adjustments: logit bias, penalties and allowed ids of the rows that have any (``None`` if no row has).
        grammar_mask: int32 ``[n, ceil(vocab / 32)]`` allowed-token bits of constrained rows (``None`` if none).
        processed_logprobs: report logprobs of the processed distribution instead of the raw one.
        argmax_only: bool ``[n]`` with ``processed_logprobs`` (else ``None``): the greedy rows that sample at a
            nonzero temperature (top_k 1), whose processed distribution is their argmax alone.
        drafts: draft-model drafts that sampled rows verify by rejection sampling (``None``: rows emit their
            draws; set for TARGET_VERIFY rounds).
        return_probs: return each row's processed distribution with its token (a draft model's ``q``).
    """

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    greedy: torch.Tensor
    is_all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    seeds: torch.Tensor
    steps: torch.Tensor
    banned_rows: torch.Tensor
    banned_ids: torch.Tensor
    top_logprobs: list[int]
    need_logprobs: bool
    adjustments: LogitAdjustments | None = None
    processed_logprobs: bool = False
    argmax_only: torch.Tensor | None = None
    grammar_mask: torch.Tensor | None = None
    drafts: DraftProposals | None = None
    return_probs: bool = False

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        steps: Sequence[int],
        banned: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device,
        histories: Sequence[TokenHistory | None] | None = None,
        processed_logprobs: bool = False,
        grammars: Sequence[GrammarState | None] | None = None,
        drafts: DraftProposals | None = None,
        bad_words: Sequence[Sequence[int]] | None = None,
    ) -> SamplingBatchInfo:
        """Stack per-row parameters; ``banned[i]`` lists the token ids row ``i`` may not pick this round as it has
        not reached its ``min_new_tokens``, ``bad_words[i]`` those that would complete a bad word;
        ``histories[i]`` is row ``i``'s token history when it uses penalties."""
        greedy = [samples_greedily(p) for p in params]
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        every = [sorted({*ids, *more}) for ids, more in zip(banned, bad_words)] if bad_words is not None else banned
        banned_rows = [i for i, ids in enumerate(every) for _ in ids]
        banned_ids = [t for ids in every for t in ids]

        def tensor(values: Sequence[float | int | bool], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        sampled = [p for p, g in zip(params, greedy) if not g]
        return cls(
            temperatures=tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32),
            top_ps=tensor([p.top_p for p in params], torch.float32),
            top_ks=tensor(top_ks, torch.int64),
            min_ps=tensor([p.min_p for p in params], torch.float32),
            greedy=tensor(greedy, torch.bool),
            is_all_greedy=all(greedy),
            need_top_p=any(p.top_p < 1.0 for p in sampled),
            need_top_k=any(0 < p.top_k < vocab_size for p in sampled),
            need_min_p=any(p.min_p > 0.0 for p in sampled),
            seeds=tensor(seeds, torch.int64),
            steps=tensor(steps, torch.int64),
            banned_rows=tensor(banned_rows, torch.int64),
            banned_ids=tensor(banned_ids, torch.int64),
            top_logprobs=[p.top_logprobs if p.logprobs else 0 for p in params],
            need_logprobs=any(p.logprobs for p in params),
            adjustments=LogitAdjustments.build(params, histories or [None] * len(params), device, vocab_size),
            processed_logprobs=processed_logprobs,
            # top_k 1 takes the argmax as greedy rows do, but its distribution is truncated to that token (vLLM's
            # processed logprobs are taken after top-k); temperature 0 reports the penalised logits' log_softmax.
            argmax_only=(
                tensor([g and p.temperature >= GREEDY_TEMPERATURE for p, g in zip(params, greedy)], torch.bool)
                if processed_logprobs
                else None
            ),
            # A row with ids banned is before its min_new_tokens: its stop ids may not end it yet.
            grammar_mask=grammar_bitmask(list(grammars), vocab_size, [not ids for ids in banned]) if grammars else None,
            drafts=drafts,
        )
