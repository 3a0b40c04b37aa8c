"""Turn a parsed input row into a ``Req``: tokenize the prompt and check it against the model."""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterable
from dataclasses import replace
from typing import Any

from batchgen.errors import BatchgenError, FieldError, RowError, caller_stacklevel
from batchgen.io.rows import RowSpec
from batchgen.job.continuation import split_continuation
from batchgen.loop.detokenizer import IncrementalDetokenizer
from batchgen.loop.engine import EngineFacts
from batchgen.loop.req import Req
from batchgen.sampling.bad_words import bad_word_sequences
from batchgen.sampling.grammar import GrammarCompiler
from batchgen.sampling.penalties import TokenHistory, needs_history
from batchgen.sampling.random import derive_seed
from batchgen.sampling.row_fields import MAX_NEW_TOKENS_NAMES, make_sampling_params
from batchgen.sampling.sampling_params import SamplingParams


class RequestBuilder:
    """Validates rows against the model and tokenizer and builds requests.

    Args:
        tokenizer: a transformers tokenizer, or ``None`` (``random:`` models: token ids in, no text out).
        vocab_size: the model's vocabulary size (may exceed the tokenizer's: padded embeddings).
        context_len: prompt + output never exceed it; a prompt of this length or more is an error, but for a row
            that only scores its prompt (``max_new_tokens`` 0), whose last token is never run: context_len + 1.
        eos_token_ids: ids that end a request unless it sets ``ignore_eos``.
        defaults: sampling parameters for fields a row does not set.
        run_seed: seeds the rows that carry no ``seed``.
        chat_template_kwargs: the chat template's arguments for every ``messages`` row (``--chat-template-kwargs``);
            a row's own ``chat_template_kwargs`` add to them and take precedence.
        drawn_ids: the ids of rows that sampled with seeds derived from ``run_seed`` before (a ``Generator``'s earlier
            calls): a sampled row of one of them without a seed of its own draws the same noise again, so its
            samples repeat (the same prompt) or follow another's (where vLLM's ``LLM(seed=)`` draws new ones each
            call), which a ``UserWarning`` says once.

    Raises:
        BatchgenError: ``defaults`` hold a constraint that does not compile, or one for a model without a tokenizer.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        context_len: int,
        eos_token_ids: Iterable[int],
        defaults: SamplingParams,
        run_seed: int,
        chat_template_kwargs: dict[str, Any] | None = None,
        drawn_ids: Collection[str] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.defaults = defaults
        self.run_seed = run_seed
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.drawn_ids = drawn_ids
        self._repeat_said = False
        self.grammars = GrammarCompiler(tokenizer, vocab_size)
        if defaults.constraint is not None:  # compiled once here, so that a bad one is one error, not every row's
            name, text = defaults.constraint
            flag = f"--{name.replace('_', '-')}"
            if tokenizer is None:
                raise BatchgenError(f"{flag}: this model has no tokenizer, which a grammar needs")
            try:
                self.grammars.matcher(name, text, self.eos_token_ids)
            except FieldError as e:
                raise BatchgenError(f"{flag}: {e.message}") from None

    @classmethod
    def for_engine(
        cls,
        facts: EngineFacts,
        defaults: SamplingParams,
        run_seed: int,
        chat_template_kwargs: dict[str, Any] | None = None,
        drawn_ids: Collection[str] = (),
    ) -> RequestBuilder:
        """A builder for the engine ``facts`` describes: its tokenizer, vocabulary, context length and EOS ids, and
        the run ``defaults`` with the sampling defaults it read from a
        generation_config.json for those no option set (:meth:`SamplingParams.with_model_defaults`; checked
        together by ``batchgen.api.checks.check_sampling_defaults``)."""
        resolved = defaults.with_model_defaults(facts.sampling_defaults)
        return cls(
            facts.tokenizer,
            facts.vocab_size,
            facts.context_len,
            facts.eos_token_ids,
            resolved,
            run_seed,
            chat_template_kwargs=chat_template_kwargs,
            drawn_ids=drawn_ids,
        )

    def build(self, spec: RowSpec, source: str) -> Req:
        """The request for one row (its pass-through fields stay with the job: ``spec.passthrough``).

        Raises:
            RowError: bad sampling values, ids outside the vocabulary (given, or the tokenizer's), an empty prompt,
                a prompt that does not fit the context, a chat row for a tokenizer without a chat template.
        """

        def error(field: str, message: str) -> RowError:
            return RowError(source, spec.line, field, message)

        overrides = spec.sampling_overrides
        if spec.continuation is not None and all(overrides.get(name) is None for name in MAX_NEW_TOKENS_NAMES):
            overrides = {**overrides, "max_new_tokens": 0}  # a row that scores generates only when it says so
        try:
            params = make_sampling_params(self.defaults, overrides, self.vocab_size)
        except FieldError as e:
            raise error(e.field, e.message) from None
        if self.tokenizer is None:
            text_field = "messages" if spec.messages is not None else "prompt"
            if spec.prompt_token_ids is None or params.stop or params.bad_words:
                field = (
                    ("bad_words" if params.bad_words else "stop") if spec.prompt_token_ids is not None else text_field
                )
                raise error(
                    field, "this model has no tokenizer: give prompt_token_ids and no stop strings or bad words"
                )
            if params.constraint is not None:  # a grammar constrains text, which needs the tokenizer's vocabulary
                raise error(params.constraint[0], "this model has no tokenizer, which a grammar needs")
        try:
            prompt_field, prompt_ids, scored_from = self._tokenize(spec, error)
        except RowError:
            raise
        except Exception as e:  # the tokenizer rejects the text itself (e.g. a lone UTF-16 surrogate)
            field = "messages" if spec.messages is not None else "prompt"
            raise error(field, f"cannot tokenize: {' '.join(str(e).split())[:200]}") from None
        if not prompt_ids:
            raise error(prompt_field, "prompt is empty after tokenization")
        if spec.prompt_token_ids is None and max(prompt_ids) >= self.vocab_size:
            # A tokenizer given tokens the model was not resized for (a fine-tune's added special tokens).
            at, beyond = next((i, t) for i, t in enumerate(prompt_ids) if t >= self.vocab_size)
            token = self.tokenizer.convert_ids_to_tokens(beyond)
            message = f"tokenizes to id {beyond} ({token!r}), outside the model's vocabulary [0, {self.vocab_size})"
            raise error("continuation" if scored_from is not None and at >= scored_from else prompt_field, message)
        # A scored continuation needs its whole context: a row's own value is refused, the run's default left aside.
        if scored_from is not None and spec.sampling_overrides.get("truncate_prompt_tokens") is not None:
            raise error("truncate_prompt_tokens", "a row that scores a continuation cannot truncate its prompt")
        if params.truncate_prompt_tokens is not None and scored_from is None:
            keep = params.truncate_prompt_tokens
            prompt_ids = prompt_ids[-(self.context_len - 1 if keep == -1 else keep) :]
        if scored_from is not None:
            params = replace(params, prompt_logprobs_from=scored_from, prompt_logprobs=params.prompt_logprobs or 0)
        if params.max_new_tokens == 0 and params.prompt_logprobs is not None:
            # Only scored: the last token is a target, never run (Req.kv_target), so the positions run fit the
            # context with one token more; lm-eval's HF backend scores such windows of max_length + 1 tokens.
            if len(prompt_ids) > self.context_len + 1:
                message = f"prompt has {len(prompt_ids)} tokens, > context length {self.context_len} + 1"
                raise error(prompt_field, message + " (a row that only scores its prompt)")
        elif len(prompt_ids) >= self.context_len:
            message = f"prompt has {len(prompt_ids)} tokens, >= context length {self.context_len}"
            hint = " (truncate_prompt_tokens -1 keeps the last that fit)" if scored_from is None else ""
            raise error(prompt_field, message + hint)
        if params.prompt_logprobs_from is not None and params.prompt_logprobs_from >= len(prompt_ids):
            raise error(
                "prompt_logprobs_from",
                f"must be less than the prompt's {len(prompt_ids)} tokens, got {params.prompt_logprobs_from}",
            )
        try:
            bad_word_ids = bad_word_sequences(self.tokenizer, params.bad_words) if params.bad_words else ()
        except ValueError as e:
            raise error("bad_words", str(e)) from None
        grammar = None
        if params.constraint is not None:
            # Every EOS id closes the grammar, ignore_eos or not (the grammar must end on one of them, and an EOS
            # it has not accepted must never end the row), and so does every stop id where the grammar is
            # complete; elsewhere a stop id is text, which would otherwise end the row with its output incomplete.
            try:
                grammar = self.grammars.matcher(
                    *params.constraint, self.eos_token_ids, params.stop_token_ids, params.skip_special_tokens
                )
            except FieldError as e:
                raise error(e.field, e.message) from None
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        return Req(
            rid=spec.id,
            prompt_ids=prompt_ids,
            params=params,
            seed=params.seed if params.seed is not None else self._derived_seed(spec.id, params),
            stop_token_ids=stop_ids,
            max_total_len=self.context_len,
            detokenizer=(
                IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens) if params.stop else None
            ),
            history=TokenHistory(frozenset(prompt_ids)) if needs_history(params) else None,
            grammar=grammar,
            bad_word_ids=bad_word_ids,
            unforked_samples=params.n - 1,
        )

    def _derived_seed(self, rid: str, params: SamplingParams) -> int:
        """The seed of row ``rid``, which gives none, from the run seed (:func:`derive_seed`); said once where the
        row samples and one of ``drawn_ids``."""
        samples = not params.is_greedy and params.max_new_tokens > 0
        if samples and rid in self.drawn_ids and not self._repeat_said:
            self._repeat_said = True
            warnings.warn(
                f"row '{rid}' draws with the seed a sampled row of an earlier call drew with (the Generator's seed and "
                "the same id), so its samples repeat that row's, or follow them for another prompt: give rows their "
                "own seed or other ids, or n for several samples (said once a call)",
                UserWarning,
                stacklevel=caller_stacklevel(),
            )
        return derive_seed(self.run_seed, rid)

    def _tokenize(self, spec: RowSpec, error: Any) -> tuple[str, list[int], int | None]:
        """The prompt's field, its token ids (with the continuation's, when the row has one) and where the
        continuation's begin (``None`` without one)."""
        if spec.prompt_token_ids is not None:
            bad = next((t for t in spec.prompt_token_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise error("prompt_token_ids", f"id {bad} is outside the vocabulary [0, {self.vocab_size})")
            return "prompt_token_ids", list(spec.prompt_token_ids), None
        if spec.messages is not None:
            if not getattr(self.tokenizer, "chat_template", None):
                raise error("messages", "the model's tokenizer has no chat template; give a plain prompt instead")
            try:
                # A row's null leaves the run's argument at the template's default.
                given = {**self.chat_template_kwargs, **(spec.chat_template_kwargs or {})}
                if spec.tools is not None:  # over --chat-template-kwargs' tools, as a row's own value is
                    given["tools"] = spec.tools
                kwargs = {key: value for key, value in given.items() if value is not None}
                text = self.tokenizer.apply_chat_template(
                    spec.messages,
                    add_generation_prompt=spec.add_generation_prompt,
                    continue_final_message=spec.continue_final_message,
                    tokenize=False,
                    **kwargs,
                )
            except Exception as e:  # template errors are the row's fault (e.g. a role the template rejects)
                raise error("messages", f"chat template failed: {e}") from None
            # The template already contains the special tokens (BOS included) it wants.
            field, special = "messages", False
        else:
            assert spec.prompt is not None
            field, text, special = "prompt", spec.prompt, True

        def encode(piece: str) -> list[int]:
            # Not verbose: transformers would warn of a prompt over the tokenizer's model_max_length, which is not
            # the context batchgen checks (a too-long row gets batchgen's own error).
            return list(self.tokenizer(piece, add_special_tokens=special, verbose=False)["input_ids"])

        if spec.continuation is None:
            return field, encode(text), None
        # lm-eval conditions a continuation with no context on BOS (else EOS), unless the encoding brings its own.
        bos = self.tokenizer.bos_token_id
        prefix = None if encode("") else (bos if bos is not None else self.tokenizer.eos_token_id)
        context, continuation = split_continuation(encode, text, spec.continuation, prefix)
        if not context:
            raise error(field, "is empty, and the model has no BOS or EOS token to score the continuation after")
        if not continuation:
            # lm-eval's split: the continuation's tokens are those after the prompt's own count of them.
            raise error("continuation", "has no token of its own: it merges into the prompt's last token")
        return field, context + continuation, len(context)
