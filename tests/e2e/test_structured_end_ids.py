"""A grammar ends only where it is complete, on any id that ends its row, and that id is not in ``text``
(issue 22, part 3: several EOS ids in generation_config.json, stop ids, ``ignore_eos``).

The model's generation_config.json lists a second EOS id that is an ordinary text token ("c", which no grammar
here needs), and rows bias it up so that it is sampled wherever allowed: told only the tokenizer's EOS, the
grammar took it for text (inside a JSON string, in ``[a-c]``) and the row ended there, invalid (vLLM #42403).
References: ``json.loads`` with ``jsonschema``, ``re.fullmatch``, and HF transformers' greedy logits under
xgrammar's own matcher.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer

from tests.helpers.cli import generate, write_jsonl
from tests.helpers.hf_greedy import hf_constrained_greedy

xgrammar = pytest.importorskip("xgrammar", reason='grammars need xgrammar (pip install -e ".[structured]")')

REGEX = r"[a-c]{2,4}-\d{3}"
EBNF = 'root ::= "yes" | "no" | "maybe " ("so" | "not")'
SCHEMA = {
    "type": "object",
    # Seed 0 of _rows once ended "name" with a UTF-8-encoded surrogate (three U+FFFD: too long), which xgrammar
    # lets through (tests/unit/test_grammar_surrogates.py).
    "properties": {"name": {"type": "string", "maxLength": 10}, "tag": {"enum": ["x", "aa"]}},
    "required": ["name", "tag"],
    "additionalProperties": False,
}
SPEC = ("--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "4", "--speculative-ngram-min", "1")
# The model drafting for itself: its drafts go through the same grammar masks as the target's draws.
DRAFT = ("--speculative-algorithm", "draft", "--speculative-draft-model", "TARGET")
EOS = 1


@pytest.fixture(scope="module")
def two_eos_model(random_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A copy of the random llama whose generation_config.json lists EOS ids [1, id of "c"]; (dir, that id)."""
    model = tmp_path_factory.mktemp("two_eos") / "llama"
    shutil.copytree(random_models["llama"], model)
    extra = int(AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("c"))
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [EOS, extra]}))
    return model, extra


def _rows(extra: int) -> list[dict[str, Any]]:
    bias = {"logit_bias": {str(extra): 4.0}, "temperature": 1.0}
    rows = [
        {"id": f"j{s}", "prompt": "Name:", "json_schema": SCHEMA, "seed": s, "max_new_tokens": 48} for s in range(8)
    ]
    rows += [{"id": f"r{s}", "prompt": "Code:", "regex": REGEX, "seed": s, "max_new_tokens": 24} for s in range(6)]
    rows += [{"id": f"e{s}", "prompt": "Answer:", "ebnf": EBNF, "seed": s, "max_new_tokens": 12} for s in range(4)]
    return [{**row, **bias} for row in rows]


def _check(row: dict[str, Any], end_ids: set[int]) -> None:
    """A finished row is valid for its constraint and ends on one of ``end_ids``, whose text is not in ``text``."""
    assert row["finish_reason"] in ("stop", "length"), row
    if row["finish_reason"] == "length":
        return
    last = row["output_token_ids"][-1]
    assert last in end_ids and row["matched_stop"] == str(last), row
    kind = row["id"][0]
    if kind == "j":
        value = json.loads(row["text"])
        jsonschema.validate(value, SCHEMA)
        assert row["text"] == json.dumps(value, ensure_ascii=False), row
    elif kind == "r":
        assert re.fullmatch(REGEX, row["text"]), row
    else:
        assert row["text"] in {"yes", "no", "maybe so", "maybe not"}, row


@pytest.mark.parametrize("spec", [(), SPEC, DRAFT], ids=["plain", "ngram", "draft-model"])
def test_extra_eos_id_closes_grammar_only_when_complete(
    spec: tuple[str, ...], two_eos_model: tuple[Path, int], tmp_path: Path
) -> None:
    model, extra = two_eos_model
    rows = _rows(extra)
    spec = tuple(str(model) if arg == "TARGET" else arg for arg in spec)
    out = generate(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", model, *spec)
    for row in out.values():
        _check(row, {EOS, extra})
    # Not vacuous: the extra EOS is sampled, and closes rows of every kind.
    closed_by_extra = {
        r["id"][0] for r in out.values() if r["finish_reason"] == "stop" and r["matched_stop"] == str(extra)
    }
    assert closed_by_extra == {"j", "r", "e"}
    if spec:
        assert any(r["spec_accept_length"] is not None for r in out.values())  # drafts were verified


def test_stop_ids_close_grammar_only_when_complete(random_models: dict[str, Path], tmp_path: Path) -> None:
    """A row's own stop id is an end id of its grammar too where the regex is complete; before, it is the text it
    stands for (here "b", which the regex takes)."""
    model = random_models["llama"]
    b = int(AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("b"))
    rows = [
        {"id": f"r{s}", "prompt": "Code:", "regex": REGEX, "seed": s, "max_new_tokens": 24, "temperature": 1.0}
        | {"stop_token_ids": [b], "logit_bias": {str(b): 4.0}}
        for s in range(6)
    ]
    out = generate(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", model)
    for row in out.values():
        _check(row, {EOS, b})
    assert any(r["matched_stop"] == str(b) for r in out.values())


def test_a_stop_id_the_grammar_needs_is_its_text(random_models: dict[str, Path], tmp_path: Path) -> None:
    """Found by helper 82: a stop id that is also text (the token ``"``) ended a JSON string row with the string
    open (finish_reason stop, invalid JSON), and a newline stop id that the regex needed left the row no allowed
    token, so it wrote id 0 to its length. Where the grammar is not complete a stop id is its text; where it is, the
    stop id ends the row and is not in ``text``."""
    model = random_models["llama"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    quote, newline = (int(tokenizer.convert_tokens_to_ids(t)) for t in ('"', "\u010a"))  # byte-level "\n": Ċ
    schema, regex = {"type": "string", "maxLength": 6}, "[a-c]{1,3}\n[a-c]{1,3}"
    # Room for the longest string the schema allows (6 characters written as \uXXXX\uXXXX escapes: 74 tokens and
    # the end): every row must stop, and a seed's draws are another CPU's own.
    sampled = {"temperature": 1.0, "max_new_tokens": 80}
    rows = [
        {"id": f"j{s}", "prompt": "Name:", "json_schema": schema, "seed": s, "stop_token_ids": [quote]}
        | {"logit_bias": {str(quote): 4.0}, **sampled}
        for s in range(6)
    ]
    rows += [
        {"id": f"r{s}", "prompt": "Code:", "regex": regex, "seed": s, "stop_token_ids": [newline]}
        | {"logit_bias": {str(newline): 4.0}, **sampled}
        for s in range(6)
    ]
    out = generate(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", model)
    for rid, row in out.items():
        assert row["finish_reason"] == "stop" and 0 not in row["output_token_ids"], row
        stop = quote if rid[0] == "j" else newline
        assert row["output_token_ids"][-1] in (EOS, stop) and row["matched_stop"] == str(row["output_token_ids"][-1])
        if rid[0] == "j":
            jsonschema.validate(json.loads(row["text"]), schema)
        else:
            assert re.fullmatch(regex, row["text"]), row
        assert stop in row["output_token_ids"][:-1]  # the stop id as the text the grammar needed
    assert {rid[0] for rid, r in out.items() if r["matched_stop"] in (str(quote), str(newline))} == {"j", "r"}


def test_min_new_tokens_holds_back_a_stop_id_only_where_it_would_end_the_row(
    random_models: dict[str, Path], tmp_path: Path
) -> None:
    """Found by helper 83: min_new_tokens banned a stop id also where the grammar took it as text, so a row whose
    output already met its minimum came out otherwise ("bbbb" where "aaaa" ran without the minimum)."""
    model = random_models["llama"]
    a = int(AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("a"))
    row = {"prompt": "Code:", "regex": "[ab]{4}", "stop_token_ids": [a], "logit_bias": {str(a): 6.0}}
    row |= {"temperature": 0, "max_new_tokens": 8}
    rows = [{"id": "free", **row}, {"id": "min", **row, "min_new_tokens": 4}]
    out = generate(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", model)
    assert out["free"]["text"] == "aaaa" and out["free"]["output_token_ids"] == [a] * 5  # the fifth "a" ends it
    assert out["min"]["output_token_ids"] == out["free"]["output_token_ids"] and out["min"]["text"] == "aaaa"


def test_a_model_without_eos_ends_a_grammar_on_the_rows_stop_ids(random_models: dict[str, Path]) -> None:
    """Found by helper 83: with no EOS id named and none xgrammar could find, every constrained row crashed the job
    (xgrammar refuses an empty stop list): such a grammar ends on the row's stop ids, masked until it is complete."""
    from batchgen.sampling.grammar import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(random_models["llama"])
    a, b = (int(tokenizer.convert_tokens_to_ids(t)) for t in "ab")
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    compiler.matcher("regex", "[ab]{2}", eos_ids=())  # builds xgrammar's tokenizer info
    compiler._tokenizer_stops = []  # as for a tokenizer in which xgrammar finds no EOS
    state = compiler.matcher("regex", "[ab]{2}", eos_ids=(), stop_ids=[b])
    assert not state.accept(b)  # the grammar's end, refused before it is complete
    assert state.accept(a) and state.accept(a) and not state.terminated
    assert state.accept(b) and state.terminated
    assert not compiler.matcher("regex", "[ab]{2}", eos_ids=()).terminated  # no end ids at all: xgrammar's default


def test_greedy_rows_equal_hf_under_xgrammar_with_every_eos(two_eos_model: tuple[Path, int], tmp_path: Path) -> None:
    model, extra = two_eos_model
    row = {"id": "r", "prompt": "Code:", "regex": REGEX, "temperature": 0, "max_new_tokens": 24}
    rows = [row | {"logit_bias": {str(extra): 4.0}}]
    out = generate(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", model)["r"]
    want = hf_constrained_greedy(model, "Code:", ("regex", REGEX), [EOS, extra], 24, {extra: 4.0})
    assert out["output_token_ids"] == want and want[-1] == extra
    _check(out, {EOS, extra})


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_closing_eos_not_in_text_with_ignore_eos(
    temperature: float, random_models: dict[str, Path], tmp_path: Path
) -> None:
    """``ignore_eos`` with a grammar: the grammar still ends on EOS, whose text ("</s>", kept by
    ``skip_special_tokens: false``) is not in ``text``. Each row has room for the longest output its grammar allows
    (for "j" a name of 10 characters written as ``\\uXXXX\\uXXXX`` escapes: 146 tokens with the end), so each must
    stop: the sampled "j" took 32 of its former 48 tokens here and up to 45 with other seeds."""
    common = {"ignore_eos": True, "skip_special_tokens": False, "temperature": temperature, "seed": 1}
    rows = [
        {"id": "r", "prompt": "Code:", "regex": REGEX, "max_new_tokens": 24},
        {"id": "j", "prompt": "Name:", "json_schema": SCHEMA, "max_new_tokens": 160},
        {"id": "e", "prompt": "Answer:", "ebnf": EBNF, "max_new_tokens": 12},
    ]
    out = generate(
        write_jsonl(tmp_path / "p.jsonl", [r | common for r in rows]), tmp_path / "o.arrow", random_models["llama"]
    )
    for row in out.values():
        assert row["finish_reason"] == "stop" and "</s>" not in row["text"], row
        _check(row, {EOS})


@pytest.mark.parametrize("spec", [SPEC, DRAFT], ids=["ngram", "draft-model"])
def test_a_stop_id_before_min_new_tokens_is_text_to_speculation_too(
    spec: tuple[str, ...], random_models: dict[str, Path], tmp_path: Path
) -> None:
    """Found by helper 110: speculation's walk of the drafts took a stop id for the grammar's end before
    min_new_tokens, drew the positions after it unconstrained, and the row ended at 2 tokens, "length". The
    reference is the plain run (greedy, the same engine), whose every token the regex takes."""
    model = random_models["llama"]
    b = int(AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("b"))
    a = int(AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("a"))
    row = {"id": "r", "prompt_token_ids": [b] * 30, "regex": "b+", "stop_token_ids": [b], "min_new_tokens": 6}
    row |= {"allowed_token_ids": [a, b, EOS], "logit_bias": {str(a): 20.0}, "temperature": 0, "max_new_tokens": 12}
    dataset = write_jsonl(tmp_path / "p.jsonl", [row])
    plain = generate(dataset, tmp_path / "plain.arrow", model)["r"]
    assert plain["output_token_ids"] == [b] * 6 and plain["finish_reason"] == "stop", plain
    spec = tuple(str(model) if arg == "TARGET" else arg for arg in spec)
    drafted = generate(dataset, tmp_path / "spec.arrow", model, *spec)["r"]
    assert (drafted["output_token_ids"], drafted["finish_reason"]) == (plain["output_token_ids"], "stop")
