"""The scheduler: decides who runs each round. Continuous batching, chunked prefill, preemption."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any

from batchgen.loop.drafter import Drafter, RoundDrafts, accepted_length
from batchgen.loop.forward_mode import ForwardMode
from batchgen.loop.kv_cache import KVCache
from batchgen.loop.prefill_adder import PrefillAdder
from batchgen.loop.req import Req
from batchgen.loop.round_cost import RoundCostModel
from batchgen.loop.round_output import RoundTokens, record_prompt_logprobs
from batchgen.loop.schedule_batch import ScheduleBatch
from batchgen.loop.stop_checker import finalize_text
from batchgen.loop.waiting_queue import WaitingQueue
from batchgen.models.logits_processor import LogitsProcessorOutput
from batchgen.sampling.sampler import SampleOutput


@dataclass(frozen=True)
class SchedulerOptions:
    """Round-building limits.

    Attributes:
        max_running_requests: requests holding KV at once.
        max_prefill_tokens: prompt tokens per round (a single longer prompt still runs alone).
        chunked_prefill_size: longest prefill chunk per round; 0 disables chunking (prompts prefill whole).
        enable_mixed_chunk: let a prefill chunk and the running decodes share one forward (MIXED).
        new_token_ratio: fraction of the remaining ``max_new_tokens`` of each running request that may stop
            early (EOS, stop ids or strings, a grammar) kept free when admitting new requests, so admission
            rarely forces a retraction later. Without speculative decoding, requests that always run to their
            length get the room their growth needs instead (``PrefillAdder``).
    """

    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int
    enable_mixed_chunk: bool = True
    new_token_ratio: float = 0.3


class Scheduler:
    """Holds the waiting queue and the running requests, and turns them into one ``ScheduleBatch`` a round.

    Policy: waiting requests are admitted in the ``WaitingQueue``'s order (longest cached prefix first with a
    prefix cache, else first come, first served) while there is a free request row, prefill token budget and KV
    room (``PrefillAdder``); every running request decodes every round. When the KV pool cannot hold the next
    round, the most recently admitted request is retracted: its KV is freed and it goes back to the front of
    the queue, keeping its outputs, to be recomputed later (its pending tokens become prompt + outputs).
    A finished request frees its request row and KV at once.

    ``n > 1``: a row's request reserves ``n`` request rows at admission (it counts as ``n`` running requests; a
    row of more samples than run at once is queued as several such requests, :meth:`Req.sample_groups`).
    In the round that completes its prompt, samples 1..n-1 fork off (:meth:`_fork_samples`) and draw their first
    token from the same logits; they then share the prompt's KV slots (reference-counted) and decode on their
    own, each an ordinary request from there on (retracted and recomputed alone if need be).

    Request rows and KV slots are ``kv_cache``'s: the scheduler asks it for them and gives them back.
    """

    def __init__(
        self,
        options: SchedulerOptions,
        kv_cache: KVCache,
        tokenizer: Any,
        drafter: Drafter | None = None,
        pad_drafts: bool = False,
    ) -> None:
        self.options = options
        self.kv_cache = kv_cache
        self.tokenizer = tokenizer
        self.waiting = WaitingQueue(by_prefix=kv_cache.radix_cache is not None)
        self.running: list[Req] = []
        self.num_retracted = 0
        self.drafter = drafter
        self.pad_drafts = pad_drafts
        # Seconds per DECODE/TARGET_VERIFY round against its width, fed by the engine: sets the draft budget.
        self.round_cost = RoundCostModel()
        # Speculative decoding: how many verify rounds with drafts emitted 1, 2, … K + 1 tokens for one request.
        self.accept_histogram: Counter[int] = Counter()

    def add(self, req: Req) -> None:
        """Queue ``req``; its samples as groups that fit the requests that run at once (:meth:`Req.sample_groups`)."""
        for group in req.sample_groups(self.options.max_running_requests):
            self.waiting.append(group)

    def has_work(self) -> bool:
        return bool(len(self.waiting) or self.running)

    def drop_all(self) -> None:
        """Drop every waiting and running request (their caller has gone), freeing their KV as a retraction does."""
        for req in self.running:
            self._release(req)
        self.running = []
        self.waiting = WaitingQueue(by_prefix=self.kv_cache.radix_cache is not None)

    def next_batch(self) -> ScheduleBatch | None:
        """The next round, or ``None`` when nothing is waiting or running."""
        while True:
            decodes = self._make_room_for_decodes()
            prefill_reqs, prefill_lens, admitted = self._prefill_rows(reserved=len(decodes))
            if decodes or prefill_reqs or len(self.running) <= 1:
                break
            # Only partly prefilled requests hold the pool and none can grow: free the newest.
            self._retract(self.running[-1])
        if prefill_reqs and decodes and self.options.enable_mixed_chunk:
            batch = ScheduleBatch(
                ForwardMode.MIXED, prefill_reqs + decodes, prefill_lens + [1] * len(decodes), len(decodes)
            )
        elif prefill_reqs:
            batch = ScheduleBatch(ForwardMode.EXTEND, prefill_reqs, prefill_lens)
        elif decodes:
            batch = self._decode_batch(decodes)
        else:
            return None
        batch.cached_tokens, batch.admitted_prompt_tokens = admitted
        self._fork_samples(batch)
        return batch

    def stuck_message(self) -> str:
        """What :meth:`next_batch` could not schedule although work remains (a fault, never a user's mistake)."""
        waiting = self.waiting.in_order()
        first = waiting[0] if waiting else self.running[0]
        return (
            f"scheduler made no round: {len(waiting)} waiting, {len(self.running)} running; request {first.rid!r} "
            f"has {first.kv_len} of {first.fill_len} tokens cached, {self.kv_cache.available()} of "
            f"{self.kv_cache.size} KV slots available"
        )

    def process_result(
        self, batch: ScheduleBatch, result: SampleOutput, logits_output: LogitsProcessorOutput | None = None
    ) -> list[Req]:
        """Record prompt logprobs, append each request's emitted tokens, account a verify round, free finished
        requests; return those that finished."""
        if logits_output is not None and logits_output.prompt_logprobs is not None:
            record_prompt_logprobs(batch, logits_output)
        self._cache_prefills(batch)
        self._share_prompt_kv(batch)
        finished = [sample for req in batch.scored for sample in self._finish_scored(req)]
        tokens = RoundTokens.from_sample(result)
        for req, first, count, drafts, decoding in _draw_plan(batch):
            emit = accepted_length(tokens.ids[first : first + count], drafts.ids if drafts is not None else [])
            appended = tokens.emit(req, first, emit)
            if self.drafter is not None and decoding:
                self._account_verify(req, drafts, emit - 1, appended)
            if count > 1:
                self._drop_rejected_kv(req, count, emit)
            if req.finished:
                self._finish(req)
                finished.append(req)
        return finished

    def _account_verify(self, req: Req, drafts: RoundDrafts | None, accepted: int, emitted: int) -> None:
        """A decoding request's round under a drafter: the target agreed with ``accepted`` drafts and ``emitted``
        tokens were appended."""
        assert self.drafter is not None
        if drafts is not None and drafts.proposed:
            self.accept_histogram[emitted] += 1
        self.drafter.on_verified(req, drafts, accepted, emitted)

    def _finish_scored(self, req: Req) -> list[Req]:
        """Finish a request that only scored its prompt, and its other samples (the same scores, no tokens)."""
        first = req.sample_index + 1
        samples = [req.fork(i, None) for i in range(first, first + req.unforked_samples)]
        req.unforked_samples = 0
        req.finish_reason = "length"
        self._finish(req)
        for sample in samples:
            sample.finish_reason, sample.text = "length", ""
            sample.prompt_logprobs, sample.prompt_argmax = req.prompt_logprobs, req.prompt_argmax
            sample.prompt_top_logprobs = req.prompt_top_logprobs
        return [req, *samples]

    def _finish(self, req: Req) -> None:
        finalize_text(req, self.tokenizer)
        self._release(req)
        self.running.remove(req)

    def _drop_rejected_kv(self, req: Req, count: int, emit: int) -> None:
        """After verifying ``count`` positions and emitting ``emit`` tokens, keep the K/V of the pending token
        and the accepted drafts, and free the slots of the rejected ones (``kv_len`` rolls back)."""
        assert req.req_pool_idx is not None
        keep = req.kv_len - count + emit
        self.kv_cache.truncate(req.req_pool_idx, keep, req.kv_len)
        req.kv_len = keep

    def _decode_batch(self, decodes: list[Req]) -> ScheduleBatch:
        """A DECODE round, or with a drafter a TARGET_VERIFY round when any request has drafts (with the KV
        room left after one slot per request); a round of padding drafts alone decodes instead, for less."""
        if self.drafter is not None and not (self.round_cost.wants_probe() and not self.pad_drafts):
            room = self.kv_cache.available() - len(decodes)
            break_even = self.round_cost.break_even(len(decodes))
            drafts = self.drafter.plan(decodes, room, self.pad_drafts, break_even)
            if any(d.proposed for d in drafts):
                lens = [1 + len(d.ids) for d in drafts]
                return ScheduleBatch(ForwardMode.TARGET_VERIFY, decodes, lens, len(decodes), drafts)
        return ScheduleBatch(ForwardMode.DECODE, decodes, [1] * len(decodes), len(decodes))

    def _fork_samples(self, batch: ScheduleBatch) -> None:
        """Add samples 1..n-1 of every request that samples its first token this round, on the same row."""
        if not any(req.unforked_samples for _, req in batch.sampled):
            return
        sampled: list[tuple[int, Req]] = []
        for row, req in batch.sampled:
            sampled.append((row, req))
            for index, pool_row in enumerate(req.fork_rows, start=req.sample_index + 1):
                sampled.append((row, req.fork(index, pool_row)))
            req.unforked_samples, req.fork_rows = 0, []
        batch.sampled = sampled

    def _cache_prefills(self, batch: ScheduleBatch) -> None:
        """Put the tokens the round's prefill rows computed into the prefix cache: a request that shares them
        hits from the next round on, while this one is still running (and before its samples fork, which
        share its lock)."""
        for req in batch.reqs[: len(batch.reqs) - batch.num_decode_rows]:
            assert req.req_pool_idx is not None
            self.kv_cache.cache(req.req_pool_idx, req.fill_ids(req.kv_len))

    def _share_prompt_kv(self, batch: ScheduleBatch) -> None:
        """After a forking round: give each new sample the prompt's KV slots and its prompt logprobs, and
        start running it."""
        for row, req in batch.sampled:
            parent = batch.reqs[row]
            if req is parent:
                continue
            assert req.req_pool_idx is not None and parent.req_pool_idx is not None
            self.kv_cache.fork(parent.req_pool_idx, parent.kv_len, req.req_pool_idx)
            req.kv_len = parent.kv_len
            req.prompt_logprobs = list(parent.prompt_logprobs)
            req.prompt_argmax = list(parent.prompt_argmax)
            req.prompt_top_logprobs = list(parent.prompt_top_logprobs)
            self.running.append(req)

    def _make_room_for_decodes(self) -> list[Req]:
        """Running requests that decode this round, after retracting the newest ones until their KV fits."""
        while True:
            decodes = [r for r in self.running if r.is_decoding]
            if self.kv_cache.available() >= len(decodes) or len(self.running) <= 1:
                return decodes
            self._retract(self.running[-1])

    def _retract(self, req: Req) -> None:
        self._release(req)
        self.running.remove(req)
        req.kv_len = 0
        self.waiting.appendleft(req)
        self.num_retracted += 1

    def _release(self, req: Req) -> None:
        """Free the request's rows and KV; what it computed stays in the prefix cache (a finished request's
        prompt and output, a retracted one's prefix, which its recompute then mostly hits)."""
        assert req.req_pool_idx is not None
        if self.drafter is not None:
            self.drafter.release(req)
        self.kv_cache.cache(req.req_pool_idx, req.fill_ids(req.kv_len))
        self.kv_cache.release(req.req_pool_idx, req.kv_len)
        for row in req.fork_rows:
            self.kv_cache.release(row, 0)
        req.req_pool_idx, req.fork_rows = None, []

    def _prefill_rows(self, reserved: int) -> tuple[list[Req], list[int], tuple[int, int]]:
        """Chunks to prefill this round (see ``PrefillAdder``), and, of the requests admitted for the first time,
        the prompt tokens the prefix cache gave them and their prompt tokens."""
        opts = self.options
        chunk = opts.chunked_prefill_size
        adder = PrefillAdder(
            self.kv_cache,
            self.running,
            self.waiting,
            opts.max_running_requests,
            budget=min(opts.max_prefill_tokens, chunk) if chunk > 0 else opts.max_prefill_tokens,
            chunk=chunk,
            reserved=reserved,
            new_token_ratio=opts.new_token_ratio,
            exact_growth=self.drafter is None,
        )
        adder.add_chunked()
        adder.add_waiting()
        return adder.reqs, adder.lens, (adder.cached_tokens, adder.admitted_prompt_tokens)


def _draw_plan(batch: ScheduleBatch) -> list[tuple[Req, int, int, RoundDrafts | None, bool]]:
    """(request, its first draw, its number of draws, its drafts, whether it decodes) per request that drew:
    one draw per sampled request, or one per verified position."""
    if batch.drafts is not None:
        starts = [0, *itertools.accumulate(batch.extend_lens)]
        return [
            (req, starts[i], n, batch.drafts[i], True) for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens))
        ]
    first_decode_row = len(batch.reqs) - batch.num_decode_rows
    return [(req, i, 1, None, row >= first_decode_row) for i, (row, req) in enumerate(batch.sampled)]
