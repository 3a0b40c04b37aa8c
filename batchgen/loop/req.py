"""``Req``: one prompt's state from admission to its output row."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from batchgen.loop.detokenizer import IncrementalDetokenizer
from batchgen.sampling.grammar import GrammarState
from batchgen.sampling.penalties import TokenHistory
from batchgen.sampling.random import derive_seed
from batchgen.sampling.sampling_params import SamplingParams


@dataclass
class Req:
    """A request as the scheduler sees it.

    KV invariant: the first ``kv_len`` tokens of ``fill_ids`` (prompt + outputs) have K/V in the pool; the rest
    are *pending* and go into the next forward. A decoding request has exactly one pending token (the last one
    sampled); a retracted request has ``kv_len == 0`` and recomputes everything.

    Attributes:
        rid: the row's ``id`` (shared by its ``n`` samples).
        seed: the seed its noise is drawn from (the row's own, or one derived for it; a sample's from the row's).
        row_seed: the seed of the row's sample 0, from which the other samples' derive; ``None`` on sample 0
            itself, whose :attr:`seed` it is.
        stop_token_ids: EOS ids (unless ignore_eos) plus the row's stop_token_ids.
        max_total_len: the context length; prompt + output never exceed it.
        sample_index: which of the row's ``n`` samples this is; the row's first request is sample 0.
        unforked_samples: the samples after this one (``sample_index + 1`` on) that fork off it when the prompt's
            prefill completes: n - 1 on sample 0, unless the row's samples run as groups (:meth:`sample_groups`).
        fork_rows: ``req_to_token`` rows reserved at admission for those samples.
        draft_state: speculative decoding's bookkeeping for this request (``speculative.draft_state.DraftState``;
            opaque to the loop), ``None`` without a drafter.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    stop_token_ids: frozenset[int]
    max_total_len: int
    detokenizer: IncrementalDetokenizer | None = None
    history: TokenHistory | None = None
    grammar: GrammarState | None = None
    # The token sequences of the row's bad_words (batchgen.sampling.bad_words).
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Raw logprob of prompt token prompt_logprob_start + i given the tokens before it, filled chunk by chunk during
    # prefill; whether that token is the argmax there; the most likely tokens there.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_argmax: list[bool] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    req_pool_idx: int | None = None
    kv_len: int = 0
    finish_reason: str | None = None
    matched_stop: str | None = None
    # Output tokens whose text was streamed before the one that completed a stop string; None if none did.
    stop_search_from: int | None = None
    text: str | None = None
    sample_index: int = 0
    row_seed: int | None = None
    unforked_samples: int = 0
    fork_rows: list[int] = field(default_factory=list)
    draft_state: Any = None

    @property
    def fill_len(self) -> int:
        """Prompt plus output tokens: what the KV cache must hold before the next token can be sampled."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining_tokens(self) -> int:
        """Output tokens it may still add: up to ``max_new_tokens``, within its context length."""
        return max(0, min(self.params.max_new_tokens - len(self.output_ids), self.max_total_len - self.fill_len))

    @property
    def runs_to_length(self) -> bool:
        """Nothing can end it before :attr:`remaining_tokens`: no EOS or stop ids, stop strings or grammar."""
        return not self.stop_token_ids and not self.params.stop and self.grammar is None

    @property
    def scores_only(self) -> bool:
        """Prefilled for its prompt logprobs alone (``max_new_tokens`` 0): no token follows its last prompt token,
        so that token needs no forward (its K/V and logits would serve nothing)."""
        return self.params.max_new_tokens == 0 and self.params.prompt_logprobs is not None

    @property
    def kv_target(self) -> int:
        """The tokens that need K/V before the request finishes or samples its next token."""
        return self.fill_len - 1 if self.scores_only else self.fill_len

    @property
    def num_pending(self) -> int:
        return self.kv_target - self.kv_len

    @property
    def prompt_logprob_start(self) -> int:
        """The first prompt token whose logprob is reported (its logits come from the position before it)."""
        return self.params.prompt_logprobs_from or 1

    @property
    def next_prompt_logprob_pos(self) -> int:
        """The first position whose logits give a prompt logprob not reported yet."""
        return self.prompt_logprob_start - 1 + len(self.prompt_logprobs)

    @property
    def is_decoding(self) -> bool:
        """Its whole prompt has K/V and one sampled token is pending: it takes a DECODE row. (A prompt with one
        token left to prefill is still prefilling: the round that finishes it may also fork its samples.)"""
        return self.num_pending == 1 and self.kv_len >= len(self.prompt_ids)

    def fill_ids(self, end: int) -> list[int]:
        """The first ``end`` tokens of prompt + outputs."""
        prompt_len = len(self.prompt_ids)
        if end <= prompt_len:
            return self.prompt_ids[:end]
        return self.prompt_ids + self.output_ids[: end - prompt_len]

    @property
    def match_limit(self) -> int:
        """The most leading tokens a cached prefix may give this request at admission: all but the last
        pending one, whose logits give the next token; none from the first position whose prompt logprob it still
        needs, since a cached position yields no logits."""
        limit = self.kv_target - 1
        if self.params.prompt_logprobs is not None:
            limit = min(limit, self.next_prompt_logprob_pos)
        return limit

    def pending_ids(self, count: int) -> list[int]:
        """The next ``count`` tokens that need K/V, from prompt then outputs."""
        start, end = self.kv_len, self.kv_len + count
        prompt_len = len(self.prompt_ids)
        if end <= prompt_len:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(0, start - prompt_len) : end - prompt_len]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def fork(self, sample_index: int, req_pool_idx: int | None) -> Req:
        """Sample ``sample_index`` of this row, made when the prompt is prefilled and nothing is sampled yet.

        It has its own seed (derived from (the row's seed, sample_index)), penalty history, grammar matcher and
        detokenizer; the scheduler gives it the prompt's KV slots once the forking round has run.
        """
        assert not self.output_ids, "samples fork before the first output token"
        detokenizer = self.detokenizer
        row_seed = self.seed if self.row_seed is None else self.row_seed
        return replace(
            self,
            seed=derive_seed(row_seed, sample_index),
            row_seed=row_seed,
            detokenizer=(
                IncrementalDetokenizer(
                    detokenizer.tokenizer, self.prompt_ids, detokenizer.skip_special, detokenizer.context_start
                )
                if detokenizer is not None
                else None
            ),
            history=TokenHistory(self.history.prompt_tokens) if self.history is not None else None,
            grammar=self.grammar.fork() if self.grammar is not None else None,
            output_ids=[],
            output_logprobs=[],
            output_top_logprobs=[],
            prompt_logprobs=[],
            prompt_argmax=[],
            prompt_top_logprobs=[],
            req_pool_idx=req_pool_idx,
            kv_len=0,
            sample_index=sample_index,
            unforked_samples=0,
            fork_rows=[],
            draft_state=None,
        )

    def sample_groups(self, size: int) -> list[Req]:
        """This request and the samples it forks, as requests of at most ``size`` samples each: itself with the
        first ``size``, then one more request (:meth:`fork`, its prompt prefilled again: from the prefix cache
        where one runs) per ``size`` samples after them, each forking the rest of its group. vLLM likewise runs a
        row's ``n`` samples as requests of their own, so that ``n`` may exceed the requests that run at once.

        Each sample keeps its index and seed, so its tokens are those it draws in one group (bitwise so where the
        logits do not depend on the batch: ``--deterministic``)."""
        count = 1 + self.unforked_samples
        if count <= size:
            return [self]
        groups = [self]
        end = self.sample_index + count
        for first in range(self.sample_index + size, end, size):
            leader = self.fork(first, None)
            leader.unforked_samples = min(size, end - first) - 1
            groups.append(leader)
        self.unforked_samples = size - 1
        return groups
