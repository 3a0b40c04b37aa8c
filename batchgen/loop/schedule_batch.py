"""``ScheduleBatch`` (the scheduler's choice for a round) and ``ModelWorkerBatch`` (what the worker needs)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from batchgen.loop.forward_mode import ForwardMode
from batchgen.loop.kv_pool import KVSlotAllocator, ReqToTokenPool
from batchgen.loop.req import Req
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
class ScheduleBatch:
    """The requests of one round and how many pending tokens each processes (``extend_lens``).

    A row whose ``extend_len`` covers all its pending tokens samples a token this round; the others are
    non-final chunks of a chunked prefill. The last ``num_decode_rows`` rows are decodes. ``sampled`` lists
    (row, request) per token drawn: the row's own request, and, in the round that completes an ``n > 1``
    prompt, its other samples too, all drawn from that row's logits.

    TARGET_VERIFY rounds (speculative decoding): each row processes its pending token followed by its
    ``draft_ids``, and samples at every one of those positions, as if each draft before it had been accepted.
    """

    forward_mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]
    num_decode_rows: int = 0

    def __post_init__(self) -> None:
        self.sampled = [(i, r) for i, (r, n) in enumerate(zip(self.reqs, self.extend_lens)) if n == r.num_pending]
        # (row, count): how many prompt logprobs each row gets from this round, filled by prepare().
        self.prompt_logprob_rows: list[tuple[int, int]] = []

    def prepare(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: KVSlotAllocator,
        vocab_size: int,
        device: torch.device,
        processed_logprobs: bool = False,
    ) -> ModelWorkerBatch:
        """Allocate KV slots for the round's tokens, record them in ``req_to_token`` and build the tensors.

        Advances each request's ``kv_len``: the forward that consumes this batch writes those K/V.

        Raises:
            RuntimeError: if the pool cannot hold the round (the scheduler sizes rounds so it can).
        """
        prefix_lens = [r.kv_len for r in self.reqs]
        input_ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        prompt_lp_indices: list[int] = []
        prompt_lp_targets: list[int] = []
        prompt_top_k = 0
        verify = self.forward_mode.is_target_verify()
        for row, (req, n) in enumerate(zip(self.reqs, self.extend_lens)):
            assert req.req_pool_idx is not None
            if req.params.prompt_logprobs is not None:
                # Positions whose next token is a prompt token and whose logprob is not known yet (a retracted
                # request recomputes its prompt but keeps what it reported).
                first = max(req.kv_len, len(req.prompt_logprobs))
                last = min(req.kv_len + n, len(req.prompt_ids) - 1)
                if first < last:
                    start = len(input_ids) - req.kv_len
                    prompt_lp_indices.extend(range(start + first, start + last))
                    prompt_lp_targets.extend(req.prompt_ids[first + 1 : last + 1])
                    self.prompt_logprob_rows.append((row, last - first))
                    prompt_top_k = max(prompt_top_k, req.params.prompt_logprobs)
            input_ids.extend(req.pending_ids(n) if not verify else req.pending_ids(1) + req.draft_ids)
            positions.extend(range(req.kv_len, req.kv_len + n))
            rows.extend([req.req_pool_idx] * n)
        out_cache_loc = allocator.alloc(len(input_ids))
        positions_t = torch.tensor(positions, dtype=torch.int64)
        req_to_token_pool.req_to_token[torch.tensor(rows, device=device), positions_t.to(device)] = out_cache_loc.to(
            device
        )
        for req, n in zip(self.reqs, self.extend_lens):
            req.kv_len += n
        is_extend = self.forward_mode.is_extend() or verify
        # (token index, request, draft position) of every token drawn this round.
        if verify:
            starts = [0, *itertools.accumulate(self.extend_lens)]
            draws = [(starts[i] + j, r, j) for i, r in enumerate(self.reqs) for j in range(self.extend_lens[i])]
        else:
            ends = [end - 1 for end in itertools.accumulate(self.extend_lens)]
            draws = [(ends[row], r, 0) for row, r in self.sampled]
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=positions_t,
            out_cache_loc=out_cache_loc,
            req_pool_indices_cpu=[r.req_pool_idx for r in self.reqs if r.req_pool_idx is not None],
            seq_lens_cpu=[r.kv_len for r in self.reqs],
            extend_seq_lens_cpu=list(self.extend_lens) if is_extend else None,
            extend_prefix_lens_cpu=prefix_lens if is_extend else None,
            sample_indices=torch.tensor([index for index, _, _ in draws], dtype=torch.int64),
            sampling_info=SamplingBatchInfo.from_params(
                [r.params for _, r, _ in draws],
                seeds=[r.seed for _, r, _ in draws],
                steps=[len(r.output_ids) + j for _, r, j in draws],
                banned=[
                    sorted(r.stop_token_ids) if len(r.output_ids) + j < r.params.min_new_tokens else []
                    for _, r, j in draws
                ],
                vocab_size=vocab_size,
                device=device,
                histories=[r.history_after_drafts(j) for _, r, j in draws],
                grammars=[r.draft_grammars[j] if j else r.grammar for _, r, j in draws],
                processed_logprobs=processed_logprobs,
                drafts=_draft_proposals(draws, vocab_size) if verify else None,
            ),
            prompt_logprob_indices=torch.tensor(prompt_lp_indices, dtype=torch.int64),
            prompt_logprob_targets=torch.tensor(prompt_lp_targets, dtype=torch.int64),
            prompt_top_k=prompt_top_k,
        )


def _draft_proposals(draws: list[tuple[int, Req, int]], vocab_size: int) -> DraftProposals | None:
    """The verify rows that decide a draft by rejection sampling: draw ``(token index, request, j)`` with
    ``j < len(draft_ids)`` of a request whose drafter gave ``draft_probs``; a draft past those (padding) has a
    one-hot ``q``. ``None`` when no request has any."""
    rows, token_ids, probs = [], [], []
    for row, (_, req, j) in enumerate(draws):
        q = req.draft_probs
        if q is None or j >= len(req.draft_ids):
            continue
        rows.append(row)
        token_ids.append(req.draft_ids[j])
        if j < len(q):
            probs.append(q[j])
        else:
            probs.append(
                torch.nn.functional.one_hot(torch.tensor(req.draft_ids[j], device=q.device), vocab_size).float()
            )
    if not rows:
        return None
    device = probs[0].device
    return DraftProposals(
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(token_ids, dtype=torch.int64, device=device),
        torch.stack(probs),
    )
