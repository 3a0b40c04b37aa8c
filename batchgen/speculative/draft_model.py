"""Draft-model drafting: a smaller model with the target's vocabulary proposes K tokens per request per round.

The draft model has its own ``ModelRunner`` and pools (request rows, KV slots), sized like the target's. Each
round, for the requests given a limit > 0:

(a) catch-up, one batched forward (DRAFT_EXTEND; DECODE when every request lacks exactly one token): each
    request feeds the tokens of its prompt + output whose draft K/V are missing (all of them the first time,
    afterwards those emitted since: one, or two when all K drafts were accepted) and samples draft 1 at its last
    position;
(b) up to K − 1 batched DECODE steps, each feeding the previous draft (writing its draft K/V) and sampling the
    next one.

After the target's verify round :meth:`DraftModelDrafter.forget_rejected` frees the draft K/V of rejected drafts,
so the draft KV always holds a prefix of the request's actual tokens. Sampled rows' drafts are drawn with the
target's noise (``draft_steps.py``); with ``rejection`` acceptance each one's distribution goes to the verify
round with the drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchgen.errors import BatchgenError
from batchgen.loop.forward_mode import ForwardMode
from batchgen.loop.kv_cache import KVCache
from batchgen.loop.kv_pool import KVSlotAllocator
from batchgen.loop.model_runner import ModelRunner
from batchgen.loop.req import Req
from batchgen.models.config import ModelConfig
from batchgen.models.source import ModelSource
from batchgen.sampling.sampling_batch_info import samples_greedily
from batchgen.speculative.draft_state import DraftState
from batchgen.speculative.draft_steps import Drafting, DraftRow, draft_forward, seq_tokens
from batchgen.speculative.verify import Proposal, SpeculativeDrafter


class DraftModelDrafter(SpeculativeDrafter):
    """Drafts with a small model on the target's device, in its dtype (see the module docstring).

    Args:
        spec: the draft model (directory, .gguf, built-in name, hub id or ``random:PRESET``).
        num_draft_tokens: K, drafts per request per round.
        target: the engine's runner; the draft's pools get its request rows, context length and KV slot count.
        attention_backend, cuda_graph_max_bs: as for the target's runner.
        acceptance: ``rejection`` (sampled rows' drafts are verified by rejection sampling: keep their
            distributions) or ``coupled`` (see ``verify.py``).

    Raises:
        BatchgenError: the draft cannot be resolved or loaded, or its vocabulary size differs from the target's.
    """

    def __init__(
        self,
        spec: str,
        num_draft_tokens: int,
        target: ModelRunner,
        attention_backend: str,
        cuda_graph_max_bs: int,
        acceptance: str = "rejection",
    ) -> None:
        self.num_draft_tokens = num_draft_tokens
        self.keep_probs = acceptance == "rejection"
        # The draft runs at every position of the target's context, also past its own max_position_embeddings
        # (its drafts just get worse there; outputs stay exact).
        context_len = target.req_to_token_pool.max_context_len
        try:
            source = ModelSource.open(spec)
            vocab_size = ModelConfig.from_hf(source.hf_config).vocab_size
            if vocab_size != target.vocab_size:
                raise BatchgenError(
                    f"vocabulary of {vocab_size} tokens, the target model's has {target.vocab_size}; the draft must "
                    "share the target's tokenizer"
                )
            model = source.load(
                target.dtype, target.device, context_len, target.switches, target.deterministic, attention_backend
            )
        except BatchgenError as e:
            raise BatchgenError(f"--speculative-draft-model {spec}: {e}") from None
        pool_size = target.token_to_kv_pool.size
        self.runner = ModelRunner(
            model,
            target.device,
            target.dtype,
            pool_size,
            target.req_to_token_pool.max_reqs,
            context_len,
            attention_backend,
            cuda_graph_max_bs=cuda_graph_max_bs,
            switches=target.switches,
            deterministic=target.deterministic,
        )
        self.kv_cache = KVCache(self.runner.req_to_token_pool, KVSlotAllocator(pool_size))

    def propose_batch(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[Proposal]:
        """Up to ``limits[i]`` drafts for each request: one catch-up forward, then up to ``max(limits) - 1``
        DECODE steps of the draft model. A request the draft pool has no room for this round gets none."""
        items = self._admit(reqs, limits)
        if items:
            missing = [seq_tokens(it.req, it.state.kv_len, it.req.fill_len) for it in items]
            # One missing token each (a draft was rejected): a plain DECODE, which the graph runner can replay.
            mode = ForwardMode.DECODE if all(len(m) == 1 for m in missing) else ForwardMode.DRAFT_EXTEND
            draft_forward(self.runner, self.kv_cache, mode, items, missing)
            while going := [it for it in items if not it.done]:
                for it in going:
                    it.state.fed.append(it.drafts[-1])
                draft_forward(
                    self.runner, self.kv_cache, ForwardMode.DECODE, going, [it.state.fed[-1:] for it in going]
                )
        proposals: dict[int, Proposal] = {
            id(it.req): (it.drafts, torch.stack(it.probs) if it.probs else None) for it in items
        }
        return [proposals.get(id(req), ([], None)) for req in reqs]

    def forget_rejected(self, req: Req) -> None:
        """Keep the draft K/V of the drafts that equal what the request emitted; free the rest."""
        state = _draft_row(req)
        if state is None or not state.fed:
            return
        start = state.kv_len - len(state.fed)
        emitted = seq_tokens(req, start, min(state.kv_len, req.fill_len))
        matched = next((i for i, (a, b) in enumerate(zip(emitted, state.fed)) if a != b), len(emitted))
        self._truncate(state, start + matched)

    def release(self, req: Req) -> None:
        """Free the request's draft row and draft K/V (it finished, or was retracted: then it catches up from
        scratch when it decodes again)."""
        state = _draft_row(req)
        if state is None:
            return
        self.kv_cache.release(state.row, state.kv_len)
        DraftState.of(req).proposer = None

    def _truncate(self, state: DraftRow, keep: int) -> None:
        """Free the draft K/V of positions ``keep..kv_len - 1``."""
        self.kv_cache.truncate(state.row, keep, state.kv_len)
        state.kv_len, state.fed = keep, []

    def _admit(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[Drafting]:
        """The requests that draft this round, each with a draft row and room for its catch-up and K − 1 steps.

        The draft pool has the target's size but keeps no prefix cache: where the target's requests share a
        prompt prefix (or an ``n > 1`` prompt), the draft holds a copy per request, so room can run out here; a
        request without room drafts nothing this round and decodes plainly.
        """
        room = self.kv_cache.available()
        items = []
        for req, limit in zip(reqs, limits):
            if limit <= 0:
                continue
            state = _draft_row(req)
            if state is None:
                if not self.kv_cache.available_rows():
                    continue
                state = DraftState.of(req).proposer = DraftRow(self.kv_cache.allocate_rows(1)[0])
            self.forget_rejected(req)  # a no-op unless the last round's drafts were never verified
            if state.kv_len == req.fill_len:
                # Every token has draft K/V (a truncated draft run continued as emitted): recompute the last one,
                # whose logits give draft 1.
                self._truncate(state, state.kv_len - 1)
            need = req.fill_len - state.kv_len + limit - 1
            if need > room:
                continue
            room -= need
            items.append(Drafting(req, state, limit, keep_probs=self.keep_probs and not samples_greedily(req.params)))
        return items


def _draft_row(req: Req) -> DraftRow | None:
    """``req``'s place in the draft pools, ``None`` while it has none."""
    state: DraftState | None = req.draft_state
    return state.proposer if state is not None else None
