"""``ScheduleBatch`` (the scheduler's choice for a round) and ``ModelWorkerBatch`` (what the worker needs)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from batchgen.loop.drafter import RoundDrafts
from batchgen.loop.forward_mode import ForwardMode
from batchgen.loop.kv_cache import KVCache
from batchgen.loop.req import Req
from batchgen.sampling.bad_words import bad_word_bans
from batchgen.sampling.grammar import banned_before_min_tokens
from batchgen.sampling.rejection import DraftProposals
from batchgen.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class ModelWorkerBatch:
    """One round's inputs as CPU tensors and host lists; ``ForwardBatch.init_new`` moves them to the device.

    input_ids, positions, out_cache_loc: int64 ``[T]``; sample_indices: int64 ``[num_sampled]``, positions in
    the token axis whose logits are needed (each sampling row's last token). prompt_logprob_indices /
    prompt_logprob_targets: int64 ``[m]`` positions in the token axis and the prompt token that follows each, for
    rows that report prompt logprobs; prompt_top_k: how many top logprobs the widest of them wants.
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices_cpu: list[int]
    seq_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int] | None
    extend_prefix_lens_cpu: list[int] | None
    sample_indices: torch.Tensor
    sampling_info: SamplingBatchInfo
    prompt_logprob_indices: torch.Tensor
    prompt_logprob_targets: torch.Tensor
    prompt_top_k: int


@dataclass
class _PromptLogprobPlan:
    """Which positions of a round report prompt logprobs: token-axis ``indices``, the prompt token that follows
    each (``targets``), and the widest top-k asked."""

    indices: list[int]
    targets: list[int]
    top_k: int = 0


# A token drawn this round: (its index in the token axis, its request, its draft position j, the request's drafts).
_Draw = tuple[int, Req, int, RoundDrafts | None]


@dataclass
class ScheduleBatch:
    """The requests of one round and how many pending tokens each processes (``extend_lens``).

    A row whose ``extend_len`` covers all its pending tokens samples a token this round (or, scoring its prompt
    only, finishes: ``scored``); the others are non-final chunks of a chunked prefill. The last
    ``num_decode_rows`` rows are decodes. ``sampled`` lists (row, request) per token drawn: the row's own
    request, and, in the round that completes an ``n > 1`` prompt, its other samples too, all drawn from that
    row's logits.

    TARGET_VERIFY rounds (speculative decoding): row ``i`` processes its pending token followed by
    ``drafts[i].ids``, and samples at every one of those positions, as if each draft before it had been accepted.
    """

    forward_mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]
    num_decode_rows: int = 0
    drafts: list[RoundDrafts] | None = None

    def __post_init__(self) -> None:
        complete = [(i, r) for i, (r, n) in enumerate(zip(self.reqs, self.extend_lens)) if n == r.num_pending]
        self.sampled = [(i, r) for i, r in complete if not r.scores_only]
        # Requests that only score their prompt and whose last chunk this is: they finish, drawing nothing.
        self.scored = [r for _, r in complete if r.scores_only]
        # (row, count): how many prompt logprobs each row gets from this round, filled by prepare().
        # Of the requests admitted for the first time this round: the prompt tokens the prefix cache gave them,
        # and all their prompt tokens (set by the scheduler).
        self.cached_tokens = 0
        self.admitted_prompt_tokens = 0
        self.prompt_logprob_rows: list[tuple[int, int]] = []

    def prepare(
        self, kv_cache: KVCache, vocab_size: int, device: torch.device, processed_logprobs: bool = False
    ) -> ModelWorkerBatch:
        """Allocate KV slots for the round's tokens (``kv_cache`` records them in ``req_to_token``) and build the
        tensors.

        Advances each request's ``kv_len``: the forward that consumes this batch writes those K/V.

        Raises:
            RuntimeError: if the pool cannot hold the round (the scheduler sizes rounds so it can).
        """
        prefix_lens = [r.kv_len for r in self.reqs]
        input_ids, positions, rows = self._kv_layout()
        prompt_plan = self._prompt_logprob_plan()
        out_cache_loc = kv_cache.allocate(rows, positions)
        for req, n in zip(self.reqs, self.extend_lens):
            req.kv_len += n
        is_extend = self.forward_mode.is_extend() or self.forward_mode.is_target_verify()
        draws = self._draws()
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices_cpu=[r.req_pool_idx for r in self.reqs if r.req_pool_idx is not None],
            seq_lens_cpu=[r.kv_len for r in self.reqs],
            extend_seq_lens_cpu=list(self.extend_lens) if is_extend else None,
            extend_prefix_lens_cpu=prefix_lens if is_extend else None,
            sample_indices=torch.tensor([index for index, _, _, _ in draws], dtype=torch.int64),
            sampling_info=_sampling_info(draws, vocab_size, device, processed_logprobs),
            prompt_logprob_indices=torch.tensor(prompt_plan.indices, dtype=torch.int64),
            prompt_logprob_targets=torch.tensor(prompt_plan.targets, dtype=torch.int64),
            prompt_top_k=prompt_plan.top_k,
        )

    def _kv_layout(self) -> tuple[list[int], torch.Tensor, list[int]]:
        """The round's token ids, their positions (int64 ``[T]``) and each token's request row."""
        input_ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        for i, (req, n) in enumerate(zip(self.reqs, self.extend_lens)):
            assert req.req_pool_idx is not None
            input_ids.extend(req.pending_ids(n) if self.drafts is None else req.pending_ids(1) + self.drafts[i].ids)
            positions.extend(range(req.kv_len, req.kv_len + n))
            rows.extend([req.req_pool_idx] * n)
        return input_ids, torch.tensor(positions, dtype=torch.int64), rows

    def _prompt_logprob_plan(self) -> _PromptLogprobPlan:
        """The positions whose next token is a prompt token and whose logprob is not known yet (a retracted
        request recomputes its prompt but keeps what it reported); fills ``prompt_logprob_rows``."""
        plan = _PromptLogprobPlan([], [])
        start = 0  # the row's first token in the token axis
        for row, (req, n) in enumerate(zip(self.reqs, self.extend_lens)):
            first = max(req.kv_len, req.next_prompt_logprob_pos)
            last = min(req.kv_len + n, len(req.prompt_ids) - 1)
            if req.params.prompt_logprobs is not None and first < last:
                plan.indices.extend(range(start + first - req.kv_len, start + last - req.kv_len))
                plan.targets.extend(req.prompt_ids[first + 1 : last + 1])
                self.prompt_logprob_rows.append((row, last - first))
                plan.top_k = max(plan.top_k, req.params.prompt_logprobs)
            start += n
        return plan

    def _draws(self) -> list[_Draw]:
        """Every token drawn this round: each sampled row's last token, or every verified position."""
        if self.drafts is not None:
            starts = [0, *itertools.accumulate(self.extend_lens)]
            return [
                (starts[i] + j, r, j, self.drafts[i])
                for i, r in enumerate(self.reqs)
                for j in range(self.extend_lens[i])
            ]
        ends = [end - 1 for end in itertools.accumulate(self.extend_lens)]
        return [(ends[row], r, 0, None) for row, r in self.sampled]


def _sampling_info(
    draws: list[_Draw], vocab_size: int, device: torch.device, processed_logprobs: bool
) -> SamplingBatchInfo:
    """Each draw's sampling inputs: at draft position ``j`` those plain decoding would use after ``j`` drafts."""
    grammars = [d.grammars[j] if d is not None and j else r.grammar for _, r, j, d in draws]
    return SamplingBatchInfo.from_params(
        [r.params for _, r, _, _ in draws],
        seeds=[r.seed for _, r, _, _ in draws],
        steps=[len(r.output_ids) + j for _, r, j, _ in draws],
        banned=[
            banned_before_min_tokens(r.stop_token_ids, g) if len(r.output_ids) + j < r.params.min_new_tokens else []
            for (_, r, j, _), g in zip(draws, grammars)
        ],
        vocab_size=vocab_size,
        device=device,
        histories=[d.history_after(r.history, j) if d is not None else r.history for _, r, j, d in draws],
        grammars=grammars,
        bad_words=[
            bad_word_bans(r.bad_word_ids, r.output_ids, d.ids[:j] if d is not None else ()) for _, r, j, d in draws
        ],
        processed_logprobs=processed_logprobs,
        drafts=_draft_proposals(draws, vocab_size),
    )


def _draft_proposals(draws: list[_Draw], vocab_size: int) -> DraftProposals | None:
    """The verify rows that decide a draft by rejection sampling: draw ``(token index, request, j, drafts)`` with
    ``j < len(drafts.ids)`` of drafts that carry ``probs``; a draft past those (padding) has a one-hot ``q``.
    ``None`` when no request has any."""
    rows, token_ids, probs = [], [], []
    for row, (_, _, j, drafts) in enumerate(draws):
        if drafts is None or drafts.probs is None or j >= len(drafts.ids):
            continue
        q = drafts.probs
        rows.append(row)
        token_ids.append(drafts.ids[j])
        if j < len(q):
            probs.append(q[j])
        else:
            probs.append(torch.nn.functional.one_hot(torch.tensor(drafts.ids[j], device=q.device), vocab_size).float())
    if not rows:
        return None
    device = probs[0].device
    return DraftProposals(
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(token_ids, dtype=torch.int64, device=device),
        torch.stack(probs),
    )
