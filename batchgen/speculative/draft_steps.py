"""One forward of the draft model over a round's drafting requests, and the sampling inputs of its drafts.

Draft ``j + 1`` of a request is sampled by :func:`batchgen.sampling.sampler.sample` with the request's
parameters, seed and output step ``len(output) + j``, its penalty history and ``min_new_tokens`` bans as if
drafts ``1..j`` had been emitted, and its grammar state after them: exactly the inputs of the target's draw at
verify position ``j`` (``ScheduleBatch.prepare``). Both draws are exponential races with the same noise, which
the ``coupled`` acceptance relies on (``verify.py``); ``rejection`` acceptance keeps the distribution each draft
was drawn from instead. Greedy rows draft the draft model's argmax.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

import torch

from batchgen.loop.forward_batch import ForwardBatch
from batchgen.loop.forward_mode import ForwardMode
from batchgen.loop.kv_cache import KVCache
from batchgen.loop.model_runner import ModelRunner
from batchgen.loop.req import Req
from batchgen.loop.schedule_batch import ModelWorkerBatch
from batchgen.sampling.bad_words import bad_word_bans
from batchgen.sampling.grammar import GrammarState, banned_before_min_tokens
from batchgen.sampling.penalties import TokenHistory
from batchgen.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class DraftRow:
    """A request's place in the draft model's pools (kept in its ``DraftState.proposer``).

    Invariant between rounds: the draft KV holds the first ``kv_len`` tokens of the request's prompt + output,
    at positions ``0..kv_len - 1`` of draft request row ``row``. During a round its last ``len(fed)`` entries are
    drafts, kept after verification only where the target emitted the same tokens.
    """

    row: int
    kv_len: int = 0
    fed: list[int] = field(default_factory=list)


@dataclass
class Drafting:
    """One request's drafting in the current round: its drafts so far and the sampling state after them.

    ``history`` is a copy of the request's penalty history (``None`` without penalties) and ``grammar`` a fork
    of its grammar state (``None`` without a constraint), both advanced past the drafts; the request's own are
    never touched. With ``keep_probs`` (a sampled row verified by rejection sampling) ``probs`` holds the
    float32 ``[vocab]`` distribution each draft was drawn from.
    """

    req: Req
    state: DraftRow
    limit: int
    keep_probs: bool = False
    history: TokenHistory | None = field(init=False)
    grammar: GrammarState | None = field(init=False)
    drafts: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    done: bool = False

    def __post_init__(self) -> None:
        history = self.req.history
        self.history = TokenHistory(history.prompt_tokens, Counter(history.output_counts)) if history else None
        self.grammar = self.req.grammar

    def add(self, token_id: int, probs: torch.Tensor | None) -> None:
        """Record a new draft, drawn from ``probs`` (kept with ``keep_probs``). Drafting ends at the limit, at a
        token the grammar rejects (dropped; only possible when its mask allowed nothing), when the grammar or a
        stop token ends the request: nothing after those could be emitted."""
        num_out = len(self.req.output_ids) + len(self.drafts) + 1
        if self.grammar is not None:
            grammar = self.grammar.fork()
            if not grammar.accept(token_id, may_end=num_out >= self.req.params.min_new_tokens):
                self.done = True
                return
            self.grammar = grammar
        self.drafts.append(token_id)
        if self.keep_probs and probs is not None:
            self.probs.append(probs)
        if self.history is not None:
            self.history.add(token_id)
        # A constrained row ends only where its grammar does (a stop id may be its text: GrammarState.accept).
        stops = (
            self.grammar is None and token_id in self.req.stop_token_ids and num_out >= self.req.params.min_new_tokens
        )
        ends = self.grammar is not None and self.grammar.terminated
        self.done = len(self.drafts) >= self.limit or stops or ends


def seq_tokens(req: Req, start: int, end: int) -> list[int]:
    """Tokens ``start..end - 1`` of the request's prompt + output, without concatenating the whole sequence."""
    prompt_len = len(req.prompt_ids)
    if end <= prompt_len:
        return req.prompt_ids[start:end]
    return req.prompt_ids[start:] + req.output_ids[max(0, start - prompt_len) : end - prompt_len]


def draft_forward(
    runner: ModelRunner,
    kv_cache: KVCache,
    mode: ForwardMode,
    items: list[Drafting],
    feed: list[list[int]],
) -> None:
    """Append ``feed[i]`` (non-empty) to item ``i``'s draft KV in one forward of ``mode`` (DECODE: one token
    each), then sample each item's next draft at its last fed position and :meth:`Drafting.add` it.

    Raises:
        RuntimeError: the draft pool cannot hold the tokens (callers check its room first).
    """
    device = runner.device
    prefix_lens = [it.state.kv_len for it in items]
    input_ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    for it, tokens in zip(items, feed):
        input_ids += tokens
        positions += range(it.state.kv_len, it.state.kv_len + len(tokens))
        rows += [it.state.row] * len(tokens)
        it.state.kv_len += len(tokens)
    positions_t = torch.tensor(positions, dtype=torch.int64)
    slots = kv_cache.allocate(rows, positions_t)
    lens = [len(tokens) for tokens in feed]
    extend = mode.is_extend()
    batch = ModelWorkerBatch(
        forward_mode=mode,
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=positions_t,
        out_cache_loc=slots,
        req_pool_indices_cpu=[it.state.row for it in items],
        seq_lens_cpu=[it.state.kv_len for it in items],
        extend_seq_lens_cpu=lens if extend else None,
        extend_prefix_lens_cpu=prefix_lens if extend else None,
        sample_indices=torch.tensor([end - 1 for end in itertools.accumulate(lens)], dtype=torch.int64),
        sampling_info=draft_sampling_info(items, runner.vocab_size, device),
        prompt_logprob_indices=torch.zeros(0, dtype=torch.int64),
        prompt_logprob_targets=torch.zeros(0, dtype=torch.int64),
        prompt_top_k=0,
    )
    logits_output = runner.forward(ForwardBatch.init_new(batch, runner))
    output = runner.sample(logits_output, batch.sampling_info)
    for i, (it, token_id) in enumerate(zip(items, output.next_token_ids.tolist())):
        it.add(token_id, output.probs[i] if output.probs is not None else None)


def draft_sampling_info(items: list[Drafting], vocab_size: int, device: torch.device) -> SamplingBatchInfo:
    """Each item's next draft is drawn with what the target's draw at verify position ``len(drafts)`` uses."""
    steps = [len(it.req.output_ids) + len(it.drafts) for it in items]
    info = SamplingBatchInfo.from_params(
        [it.req.params for it in items],
        seeds=[it.req.seed for it in items],
        steps=steps,
        banned=[
            banned_before_min_tokens(it.req.stop_token_ids, it.grammar) if step < it.req.params.min_new_tokens else []
            for it, step in zip(items, steps)
        ],
        vocab_size=vocab_size,
        device=device,
        histories=[it.history for it in items],
        grammars=[it.grammar for it in items],
        bad_words=[bad_word_bans(it.req.bad_word_ids, it.req.output_ids, it.drafts) for it in items],
    )
    info.need_logprobs = False  # nobody reads a draft's logprobs: skip their log_softmax and top-k
    info.return_probs = any(it.keep_probs for it in items)
    return info
