"""Structured output: JSON schema, regex and EBNF constraints compiled by xgrammar into per-step token masks.

A constraint is a mode of sampling, not a separate service: each constrained request carries a matcher, the
round's token bitmask is filled on the CPU from the matchers and applied to the logits before anything else,
and every sampled token is fed back to its matcher. A request ends (``stop``) when its grammar terminates, which
it does only where the grammar is complete, on one of the request's end ids: every EOS id of the model (masked
until then) and the row's stop ids, which are ordinary text where the grammar is not complete (a stop id whose
token is ``"`` closes a JSON string there rather than ending the row with the string open).

Two masks make up for what xgrammar lets through. JSON strings may not hold raw control characters (json.loads
rejects them). And no constraint may produce a UTF-8-encoded surrogate: xgrammar's character classes (a JSON
string's characters, a regex's ``[^"]``) take the code points U+D800-U+DFFF, bytes ED A0-BF 80-BF, which are not
UTF-8 (RFC 3629, section 3) and decode to three U+FFFD each, so a JSON string would overrun its ``maxLength`` and
a regex would no longer match. The cut is at the second byte: right after a token whose bytes end in the lead
byte ED, tokens starting with A0-BF are masked, and tokens holding ED A0-BF inside are masked everywhere.

xgrammar matches a special token by its text, and takes an end id as text where that text completes the grammar
(then ending it): a ``choice`` of ``<|im_end|>`` took the EOS id and ended the row with an empty text. So the
compiler's vocabulary gives no text to the special tokens a row's text drops (all of them under
``skip_special_tokens``, the default; its special end ids otherwise), which xgrammar then never takes as text: the
row spells such a string out of ordinary tokens, and its end ids close the grammar only where it is complete.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import torch

from batchgen.errors import FieldError
from batchgen.sampling.constraints import compile_constraint, compile_message, constraint_grammar, import_xgrammar

# A surrogate's UTF-8 form starts with this lead byte and a second byte in this range.
_LEAD = 0xED
_SURROGATE_SECOND = range(0xA0, 0xC0)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary size, caching them by (kind, text).

    Args:
        tokenizer: the transformers tokenizer of the model.
        vocab_size: the model's vocabulary (logit) size, which may exceed the tokenizer's.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._info: Any = None  # xgrammar's TokenizerInfo of the tokenizer as it is
        self._special: frozenset[int] = frozenset()
        self._compilers: dict[frozenset[int], Any] = {}  # by the ids given no text
        self._cache: dict[tuple[frozenset[int], str, str], Any] = {}
        self._no_control_chars: torch.Tensor | None = None
        self._surrogates: SurrogateMasks | None = None
        self._allowed: dict[tuple[bool, frozenset[int]], torch.Tensor] = {}
        self._tokenizer_stops: list[int] = []  # xgrammar's guess of the EOS ids, for a model that names none
        self._startable: dict[tuple[tuple[frozenset[int], str, str], frozenset[int]], bool] = {}

    def matcher(
        self,
        kind: str,
        text: str,
        eos_ids: Collection[int],
        stop_ids: Collection[int] = (),
        skip_special: bool = True,
    ) -> GrammarState:
        """A fresh matcher for constraint ``kind`` (``json_schema``, ``regex``, ``ebnf`` or ``choice``) with source
        ``text``, for a row whose text drops the special tokens where ``skip_special`` (the module docstring).

        ``eos_ids`` close the grammar: each is masked until the grammar is complete, and allowed (and accepted,
        terminating it) there. xgrammar's own guess, the tokenizer's single EOS, misses the extra EOS ids a
        generation_config.json lists, which the matcher would then take as ordinary text (in the middle of a JSON
        string, say) while the stop check ends the row on them (vLLM #42403). Empty: the tokenizer's EOS, as
        xgrammar detects it. ``stop_ids`` (the row's) close it too where it is complete, and are ordinary text
        elsewhere (:meth:`GrammarState.accept`).

        Raises:
            FieldError: xgrammar is not installed, the constraint does not compile, or no token can start it.
        """
        xgr = import_xgrammar(kind)
        if self._info is None:
            self._info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            self._tokenizer_stops = list(self._info.stop_token_ids)
            self._surrogates = SurrogateMasks.of_vocab(self._info.decoded_vocab, self.vocab_size)
            added = getattr(self.tokenizer, "added_tokens_decoder", {})
            special = set(self.tokenizer.all_special_ids) | {i for i, token in added.items() if token.special}
            self._special = frozenset(i for i in special if 0 <= i < self.vocab_size)
        assert self._surrogates is not None  # made with the tokenizer info
        # A model that names no EOS, and whose tokenizer xgrammar finds none in, ends its grammars on the row's
        # stop ids alone (masked until the grammar is complete, as EOS ids are); with none, xgrammar's default.
        ends = sorted(eos_ids) or self._tokenizer_stops or sorted(stop_ids)
        textless = self._special if skip_special else self._special & frozenset(ends)
        key = (textless, kind, text)
        if key not in self._cache:
            constraint_grammar(kind, text)  # its refusal, as the run's before the model loads
            try:
                self._cache[key] = compile_constraint(self._compiler(xgr, textless), kind, text)
            except Exception as e:  # as constraint_grammar's
                raise FieldError(kind, f"does not compile: {compile_message(e)}") from None
        matcher = xgr.GrammarMatcher(self._cache[key], override_stop_tokens=ends or None)
        stops = frozenset(stop_ids) - frozenset(ends)
        allowed = self._allowed_mask(kind, frozenset(ends))
        stop_bits = pack_bits(_one_hot(stops, self.vocab_size)) if stops else None
        ending = Ends(ends[0] if ends else None, stops, stop_bits)
        state = GrammarState(xgr, matcher, allowed, self._surrogates, ending)
        if (key, allowed_key := frozenset(ends)) not in self._startable:
            first = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
            state.fill_mask(first, 0)
            self._startable[key, allowed_key] = bool(first.any())
        if not self._startable[key, allowed_key]:
            # Found by a helper: every token masked, the row wrote id 0 to its length.
            raise FieldError(kind, "no token can start it: it matches nothing this model can write")
        return state

    def _compiler(self, xgr: Any, textless: frozenset[int]) -> Any:
        """An ``xgrammar.GrammarCompiler`` over the tokenizer's vocabulary with no text for the ids ``textless``
        (a token of empty text is special to xgrammar, never matched as text)."""
        if textless not in self._compilers:
            info = self._info
            if textless:
                vocab = [b"" if i in textless else data for i, data in enumerate(info.decoded_vocab)]
                info = xgr.TokenizerInfo(
                    vocab,
                    xgr.VocabType.RAW,  # the decoded bytes themselves
                    vocab_size=self.vocab_size,
                    stop_token_ids=info.stop_token_ids,
                    add_prefix_space=info.add_prefix_space,
                )
            self._compilers[textless] = xgr.GrammarCompiler(info, max_threads=2)
        return self._compilers[textless]

    def _allowed_mask(self, kind: str, end_ids: frozenset[int]) -> torch.Tensor:
        """Packed int32 bits of the tokens a row of ``kind`` may ever pick (cached: rows share their EOS ids)."""
        key = (kind == "json_schema", end_ids)
        if key not in self._allowed:
            assert self._surrogates is not None
            allowed = self._surrogates.no_surrogate
            # xgrammar's JSON string rule lets raw control characters (U+0000-U+001F) through, which json.loads
            # rejects; compact JSON never needs them, so JSON-schema rows may not pick a token that contains one.
            if kind == "json_schema":
                allowed = allowed & self._control_char_mask()
            if end_ids:  # an EOS id's text never reaches the output: it may hold anything
                allowed = allowed | pack_bits(_one_hot(end_ids, self.vocab_size))
            self._allowed[key] = allowed
        return self._allowed[key]

    def _control_char_mask(self) -> torch.Tensor:
        """Packed int32 bits, set for every token whose text has no control character (decoded once)."""
        if self._no_control_chars is None:
            allowed = torch.ones(self.vocab_size, dtype=torch.bool)
            for token_id in range(min(self.vocab_size, len(self.tokenizer))):
                text = self.tokenizer.decode([token_id])
                allowed[token_id] = not any(ord(ch) < 0x20 for ch in text)
            self._no_control_chars = pack_bits(allowed)
        return self._no_control_chars


class SurrogateMasks(NamedTuple):
    """A vocabulary's masks against UTF-8-encoded surrogates (see the module docstring): packed int32 bits
    ``[ceil(vocab / 32)]`` set for the tokens whose bytes hold no ED A0-BF pair (``no_surrogate``), the same less
    the tokens starting with A0-BF (``after_lead``: what may follow a lone ED), and the tokens whose bytes end in
    ED (``ends_in_lead``)."""

    no_surrogate: torch.Tensor
    after_lead: torch.Tensor
    ends_in_lead: frozenset[int]

    @classmethod
    def of_vocab(cls, token_bytes: list[bytes], vocab_size: int) -> SurrogateMasks:
        """The masks of a vocabulary given as each token's bytes (xgrammar's ``TokenizerInfo.decoded_vocab``);
        ids past its end (padded embeddings) stay allowed."""
        known = token_bytes[:vocab_size]
        clean = [_LEAD not in data or not _holds_surrogate(data) for data in known]
        follows = [ok and not (data and data[0] in _SURROGATE_SECOND) for ok, data in zip(clean, known)]
        ends = frozenset(i for i, data in enumerate(known) if data[-1:] == bytes([_LEAD]))
        padding = [True] * (vocab_size - len(known))
        clean_mask = pack_bits(torch.tensor(clean + padding, dtype=torch.bool))
        return cls(clean_mask, pack_bits(torch.tensor(follows + padding, dtype=torch.bool)), ends)


def _holds_surrogate(data: bytes) -> bool:
    """True when ``data`` holds the first two bytes of a surrogate's UTF-8 form (ED A0-BF)."""
    return any(a == _LEAD and b in _SURROGATE_SECOND for a, b in zip(data, data[1:]))


class Ends(NamedTuple):
    """How a grammar ends: ``eos``, one of the ids its matcher ends on (``None``: xgrammar's default, no stop ids);
    the row's ``stop_ids`` that are none of those, and their packed int32 bits (``None`` for none)."""

    eos: int | None
    stop_ids: frozenset[int]
    stop_bits: torch.Tensor | None


class GrammarState:
    """One request's position in its grammar; ``allowed_mask`` (packed bits) further limits every step, and
    ``surrogates`` the step after a token that ends in a lone ED byte."""

    def __init__(
        self,
        xgr: Any,
        matcher: Any,
        allowed_mask: torch.Tensor,
        surrogates: SurrogateMasks,
        ends: Ends,
        after_lead: bool = False,
    ) -> None:
        self._xgr = xgr
        self.matcher = matcher
        self.allowed_mask = allowed_mask
        self.surrogates = surrogates
        self.ends = ends
        self.after_lead = after_lead

    def fill_mask(self, bitmask: torch.Tensor, row: int, may_end: bool = True) -> None:
        """Write the allowed next tokens into row ``row`` of an int32 ``[n, ceil(vocab / 32)]`` bitmask: the
        grammar's, less what ``allowed_mask`` rules out; and, unless the row may not end yet (``may_end``:
        ``min_new_tokens``), its stop ids where the grammar may end (where the matcher allows its EOS id)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        eos, stop_bits = self.ends.eos, self.ends.stop_bits
        ends_here = False
        if stop_bits is not None and may_end and eos is not None:
            ends_here = bool((int(bitmask[row, eos // 32]) >> eos % 32) & 1)  # the matcher allows its EOS id
        bitmask[row] &= self.allowed_mask
        if self.after_lead:
            bitmask[row] &= self.surrogates.after_lead
        if ends_here and stop_bits is not None:
            bitmask[row] |= stop_bits

    def fork(self) -> GrammarState:
        """An independent matcher at the same position (another sample of the same request)."""
        fork = self.matcher.fork()
        return GrammarState(self._xgr, fork, self.allowed_mask, self.surrogates, self.ends, self.after_lead)

    def accept(self, token_id: int, may_end: bool = True) -> bool:
        """Advance past ``token_id``; False (and no change) when the grammar does not allow it here. A stop id of
        the row ends the grammar where it may end (its matcher takes the EOS id there), unless the row may not end
        yet (``may_end``), and is text elsewhere."""
        eos = self.ends.eos
        if may_end and eos is not None and token_id in self.ends.stop_ids and self.matcher.accept_token(eos):
            return True
        accepted = bool(self.matcher.accept_token(token_id))
        if accepted:
            self.after_lead = token_id in self.surrogates.ends_in_lead
        return accepted

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


def grammar_bitmask(
    states: list[GrammarState | None], vocab_size: int, may_end: Sequence[bool] | None = None
) -> torch.Tensor | None:
    """The round's int32 bitmask ``[n, ceil(vocab / 32)]`` (all ones for unconstrained rows), or ``None``;
    ``may_end[i]``: whether row ``i``'s stop ids may end it this round (:meth:`GrammarState.fill_mask`)."""
    if not any(states):
        return None
    bitmask = torch.full((len(states), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for row, state in enumerate(states):
        if state is not None:
            state.fill_mask(bitmask, row, may_end[row] if may_end is not None else True)
    return bitmask


def banned_before_min_tokens(stop_token_ids: Collection[int], grammar: GrammarState | None) -> list[int]:
    """The ids a row may not pick before ``min_new_tokens``: its stop ids (EOS ids among them), but for a
    constrained row those its grammar may take as text (it then holds back their ending, ``may_end``)."""
    text = grammar.ends.stop_ids if grammar is not None else frozenset()
    return sorted(set(stop_token_ids) - text)


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """bool ``[vocab]`` → int32 ``[ceil(vocab / 32)]``, bit ``i % 32`` of word ``i // 32`` set when allowed
    (xgrammar's bitmask layout)."""
    words = (allowed.numel() + 31) // 32
    padded = torch.zeros(words * 32, dtype=torch.int64)
    padded[: allowed.numel()] = allowed.to(torch.int64)
    packed = (padded.view(words, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _one_hot(ids: Collection[int], size: int) -> torch.Tensor:
    """bool ``[size]``, True at ``ids``."""
    hot = torch.zeros(size, dtype=torch.bool)
    hot[list(ids)] = True
    return hot


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of float32 ``logits`` ``[n, vocab]`` with the tokens the bitmask forbids set to -inf."""
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.to(logits.device)[:, :, None] >> bits) & 1).bool().flatten(1)[:, : logits.shape[1]]
    return logits.masked_fill(~allowed, float("-inf"))
