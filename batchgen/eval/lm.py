"""``--model batchgen``: lm-evaluation-harness's model interface served by a :class:`batchgen.Generator`."""

from __future__ import annotations

import logging
import math
from typing import Any

import jinja2
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import _add_special_kwargs, has_bos_prefix, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm import tqdm

from batchgen.api.generator import Generator
from batchgen.errors import BatchgenError
from batchgen.eval import model_args
from batchgen.eval.requests import generation_row, scoring_row

logger = logging.getLogger(__name__)

# HF's default for a request that does not say how many tokens to generate.
_MAX_GEN_TOKS = 256


@register_model("batchgen")
class BatchgenLM(TemplateLM):
    """lm-eval's ``LM`` over a batchgen engine: each call's requests go to :meth:`batchgen.Generator.generate` all
    at once, so the scheduler batches them and its prefix cache shares their common prefixes (few-shot examples,
    a multiple-choice question's context).

    Requests are tokenized as lm-eval's HF backend tokenizes them (``TemplateLM._encode_pair``, ``tok_encode``
    below) and truncated by its rules (:mod:`batchgen.eval.requests`), so results equal ``--model hf``'s in the
    same dtype, up to floating-point rounding.

    A request that fails as a batchgen row (none should, once truncated) is logged as a warning naming it and
    gives ``(-inf, False)``, a rolling log-likelihood of ``-inf`` or an empty generation: the evaluation goes on.

    Args (``--model_args`` names; lm-eval casts ``8`` to an int, ``true`` to a bool):
        pretrained: the model: what ``batchgen.Generator`` takes (a directory, a ``.gguf`` file, a built-in name,
            a hub id); ``random:`` presets have no tokenizer and are refused.
        max_length: the most tokens the model reads per request (lm-eval's ``max_length``); default and largest:
            the engine's context length (the model's positions, or ``context_length``).
        max_gen_toks: generated tokens of a request that gives no ``max_gen_toks``; default 256, as HF.
        add_bos_token: as HF's: ``true``/``false`` decides whether the tokenizer adds BOS; default the tokenizer's
            own behaviour.
        prefix_token_id: the token that stands for an empty context; default BOS, else EOS, as HF.
        batch_size, max_batch_size: lm-eval's batching flags; ignored: batchgen's scheduler batches every request
            of a call (``max_running_requests`` bounds a round).
        device: lm-eval's ``--device``: batchgen's ``device`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``); a CUDA
            device on a machine without CUDA is ``auto``, as HF falls back (lm-eval's command line passes
            ``cuda:0`` when ``--device`` is not given).
        **options: the other ``batchgen.Generator`` options by Python name (``dtype``, ``seed``: default 1234,
            as lm-eval's vLLM backend, ``max_running_requests``, ``prefix_cache``, ``context_length``...); other
            backends' keys that ask for nothing batchgen does otherwise
            (:func:`batchgen.eval.model_args.other_backends_args`).

    Raises:
        BatchgenError: no ``pretrained``; an option that is no engine option (named, with a did-you-mean); a bad
            option value, named by its key (``max_length``, ``max_gen_toks``, ``prefix_token_id`` not a whole
            number; another backend's key that asks for what batchgen does not do); a model that
            cannot be loaded or has no tokenizer; a ``max_length`` beyond the engine's context length.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        max_length: int | None = None,
        max_gen_toks: int = _MAX_GEN_TOKS,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        device: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        if pretrained is None:
            raise BatchgenError(
                "--model_args needs pretrained=MODEL (a directory, .gguf file, built-in name or hub id)"
            )
        if add_bos_token is not None and not isinstance(add_bos_token, bool):  # lm-eval casts only true/false
            raise BatchgenError(f"--model_args add_bos_token: must be true or false, got {add_bos_token!r}")
        max_length = model_args.model_args_count("max_length", max_length)
        max_gen_toks = model_args.model_args_count("max_gen_toks", max_gen_toks) or _MAX_GEN_TOKS
        prefix_token_id = model_args.model_args_count("prefix_token_id", prefix_token_id, least=0)
        model_args.other_backends_args(pretrained, options)
        model_args.refuse_sampling_args(options)
        self.chat_template_args = model_args.chat_template_args(options)
        options.setdefault("seed", model_args.DEFAULT_SEED)
        # lm-eval's vLLM backend hands vLLM whole SamplingParams, to which no generation_config.json adds defaults.
        options.setdefault("generation_config", "none")
        if device is not None and (device.startswith("cpu") or torch.cuda.is_available()):
            options["device"] = device
        elif device is not None:
            # lm-eval's command line says cuda:0 when --device is not given; HF falls back to the CPU then, and so
            # does batchgen's own default (auto).
            logger.info("--device %s: no CUDA on this machine, batchgen picks the device itself (auto)", device)
        try:
            self.generator = Generator(pretrained, **options)
        except TypeError as e:  # a name that is no engine option: lm-eval's users see --model_args, one line
            raise BatchgenError(f"--model_args: {e}") from None
        except BatchgenError as e:
            raise model_args.as_model_args_error(e) from None
        engine = self.generator.engine
        if engine.tokenizer is None:
            raise BatchgenError(f"{pretrained}: lm-eval's requests are text, and this model has no tokenizer")
        self.tokenizer = engine.tokenizer
        if add_bos_token is not None:
            # HF loads its tokenizer with add_bos_token, which some tokenizers (Llama's) read at load time only.
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(engine.model_dir, add_bos_token=add_bos_token)
        self.add_bos_token = add_bos_token
        if prefix_token_id is not None and prefix_token_id >= engine.vocab_size:
            vocab = engine.vocab_size
            raise BatchgenError(
                f"--model_args prefix_token_id: {prefix_token_id} is outside the vocabulary [0, {vocab})"
            )
        self.custom_prefix_token_id = prefix_token_id
        self._max_length = max_length or engine.context_len
        if self._max_length > engine.context_len:
            message = f"{self._max_length} exceeds the context length {engine.context_len}"
            raise BatchgenError(f"--model_args max_length: {message}")
        self._max_gen_toks = max_gen_toks
        self._device = engine.device

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
    ) -> BatchgenLM:
        """As lm-eval's, but an option given both in ``--model_args`` and by lm-eval's own flags (``device``,
        ``batch_size``) takes the ``--model_args`` value, where lm-eval's failed on a repeated keyword (found by a
        user)."""
        given = {key: value for key, value in (additional_config or {}).items() if value is not None}
        return cls(**(given | arg_dict))

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None) -> BatchgenLM:
        """``--model_args`` as text (``pretrained=DIR,dtype=float32``): :meth:`create_from_arg_obj` of its options."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return int(self.custom_prefix_token_id)
        bos = self.tokenizer.bos_token_id
        return int(bos if bos is not None else self.eot_token_id)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's name with ``/`` as ``__``, as HF names it in lm-eval's request cache."""
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """``string``'s token ids, as HF's ``tok_encode``: special tokens as ``add_special_tokens`` says, else as
        ``add_bos_token`` says, else the tokenizer's default, except none added to a string that starts with the
        prefix token's text (a chat-templated prompt that has its BOS)."""
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        return list(self.tokenizer.encode(string, verbose=False, **special))  # windows cut long documents

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """``chat_history`` rendered with the tokenizer's chat template, as HF renders it: the assistant's turn
        opened (``add_generation_prompt``) or the last message continued; a template that refuses a system
        message gets the history without it, with a warning."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise BatchgenError("--apply_chat_template: the model's tokenizer has no chat template")
        render = {**self.chat_template_args, "tokenize": False, "add_generation_prompt": add_generation_prompt}
        render["continue_final_message"] = not add_generation_prompt
        try:
            return str(self.tokenizer.apply_chat_template(chat_history, **render))
        except jinja2.exceptions.TemplateError:
            logger.warning("the chat template failed: rendering the history without its system messages")
            kept = [message for message in chat_history if message["role"] != "system"]
            return str(self.tokenizer.apply_chat_template(kept, **render))

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        """``(logprob, is_greedy)`` of each continuation given its context (``TemplateLM.loglikelihood`` has
        tokenized them), in request order; ``(0.0, True)`` for a continuation of no tokens."""
        names = [f"loglikelihood request (continuation {continuation[:40]!r})" for (_, continuation), _, _ in requests]
        answers = self._score([(context, cont) for _, context, cont in requests], names, "loglikelihood", disable_tqdm)
        for (pair, _, _), answer in zip(requests, answers):
            self.cache_hook.add_partial("loglikelihood", pair, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood, as HF computes it: the text's tokens (``tok_encode``) cut into lm-eval's
        rolling windows of ``max_length`` tokens (``get_rolling_token_windows`` after the prefix token,
        ``make_disjoint_window``), every window of every text scored in one call, summed per text."""
        windows: list[tuple[list[int], list[int]]] = []
        names: list[str] = []
        counts = []
        for request in requests:
            (text,) = request.args
            found = get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length, 1)
            mine = [make_disjoint_window(window) for window in found]
            windows += mine
            names += [_name(request)] * len(mine)
            counts.append(len(mine))
        scores = iter(self._score(windows, names, "loglikelihood_rolling", disable_tqdm))
        totals = []
        for request, count in zip(requests, counts):
            total = math.fsum(logprob for logprob, _ in (next(scores) for _ in range(count)))
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            totals.append(total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each request's generation, as HF's: generated until one of its ``until`` strings or EOS, at most
        ``max_gen_toks`` tokens (:func:`batchgen.eval.requests.generation_row`); the generated tokens decoded
        without special tokens and cut before the first of its stop strings, as lm-eval cuts HF's
        (``postprocess_generated_text``)."""
        eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        rows, stops = [], []
        for request in requests:
            context, gen_kwargs = request.args
            row, until = generation_row(
                self.tok_encode(context), gen_kwargs, eos, self.max_length, self.max_gen_toks, _name(request)
            )
            rows.append(row)
            stops.append(until)
        texts = []
        for request, until, result in zip(requests, stops, self._run(rows, "generate_until", disable_tqdm)):
            if _failed(result, _name(request)):
                text = ""
            else:
                # Decoded on their own, as HF decodes them: a tokenizer may then drop the first token's leading
                # space, which batchgen's text (the prompt's continuation) keeps.
                text = self.tokenizer.decode(result["output_token_ids"], skip_special_tokens=True)
                text = postprocess_generated_text(text, until, None)
            self.cache_hook.add_partial("generate_until", request.args, text)
            texts.append(text)
        return texts

    def _score(
        self, pairs: list[tuple[list[int], list[int]]], names: list[str], kind: str, disable_tqdm: bool
    ) -> list[tuple[float, bool]]:
        """``(logprob, is_greedy)`` of each (context ids, continuation ids), all scored in one engine call."""
        answers: list[tuple[float, bool] | None] = [None] * len(pairs)
        rows, slots = [], []
        for slot, ((context, continuation), name) in enumerate(zip(pairs, names)):
            if continuation:
                # A context of whitespace alone encodes to nothing once lm-eval moves its whitespace to the
                # continuation (HF asserts there): it is an empty context, the prefix token.
                context = context or [self.prefix_token_id]
                rows.append(scoring_row(context, continuation, self.max_length, name))
                slots.append(slot)
            else:
                answers[slot] = (0.0, True)
        for slot, result in zip(slots, self._run(rows, kind, disable_tqdm)):
            failed = _failed(result, names[slot])
            answers[slot] = (-math.inf, False) if failed else (result["prompt_logprob_sum"], result["prompt_is_greedy"])
        return [answer for answer in answers if answer is not None]

    def _run(self, rows: list[dict[str, Any]], kind: str, disable_tqdm: bool) -> list[dict[str, Any]]:
        """Every row's result, in ``rows``' order. The rows reach the engine sorted by their token ids, so rows
        that share a prefix (few-shot examples, one question's choices) sit side by side in the engine's bounded
        lookahead whatever the task's order; a progress bar counts them as they finish, as HF's backend shows
        one (``Running {kind} requests``)."""
        order = sorted(range(len(rows)), key=lambda i: rows[i]["prompt_token_ids"])
        results: list[dict[str, Any]] = [{}] * len(rows)
        with tqdm(total=len(rows), desc=f"Running {kind} requests", disable=disable_tqdm) as bar:
            for result in self.generator.stream(({**rows[i], "id": str(i)} for i in order), on_error="skip"):
                results[int(result["id"])] = result
                bar.update(1)
        return results


def _name(request: Instance) -> str:
    """A request as a warning names it: its task and document."""
    return f"{request.request_type} request of task {request.task_name}, doc {request.doc_id}"


def _failed(result: dict[str, Any], name: str) -> bool:
    """Whether batchgen refused the request's row; if so, said in a warning naming the request."""
    if result["finish_reason"] != "error":
        return False
    logger.warning("%s: %s", name, result["error"])
    return True
