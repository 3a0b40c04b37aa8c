"""Structured output (xgrammar): JSON schema, regex, EBNF and choice constraints (cases B23 and B11's emoji row)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.helpers.cli import generate, read_rows, run_args, run_cli, write_jsonl
from tests.helpers.hf_greedy import hf_constrained_greedy
from tests.helpers.models import STORIES, needs_shared

CITY = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "population": {"type": "integer"}},
    "required": ["name", "population"],
    "additionalProperties": False,
}
PERSON = {
    "type": "object",
    "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "name": {"type": "string", "maxLength": 8},
        "pet": {"enum": ["cat", "dog", "fish"]},
    },
    "required": ["age", "name", "pet"],
    "additionalProperties": False,
}


def _check_json_rows(rows: dict[str, dict[str, Any]], schema: dict[str, Any]) -> int:
    """Every row that stopped is valid for the schema; rows cut short say 'length'. Returns the stopped count."""
    stopped = 0
    for row in rows.values():
        assert row["finish_reason"] in ("stop", "length"), row
        if row["finish_reason"] == "stop":
            value = json.loads(row["text"])
            jsonschema.validate(value, schema)
            # The whitespace README promises: json.dumps' default separators, nothing else.
            assert row["text"] == json.dumps(value, ensure_ascii=False), row["text"]
            stopped += 1
    return stopped


@pytest.mark.parametrize("model_name", ["stories", "random"])
def test_b23_json_schema_rows_validate(model_name: str, random_models: dict[str, Path], tmp_path: Path) -> None:
    if model_name == "stories" and not STORIES.exists():
        pytest.skip("needs ../shared/models (the workplace's shared folder; not in a fresh clone)")
    model = STORIES if model_name == "stories" else random_models["llama"]
    rows = [
        {
            "id": f"j{seed}",
            "prompt": "Tell me about a city.",
            "json_schema": CITY,
            "temperature": 1.0,
            "seed": seed,
            "max_new_tokens": 96,
        }
        for seed in range(20)
    ]
    rows.append(
        {
            "id": "jbad",
            "prompt": "x",
            "max_new_tokens": 16,
            "json_schema": {
                "type": "object",
                "properties": {"n": {"type": "integer", "multipleOf": 7}},
                "required": ["n"],
            },
        }
    )
    out = generate(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", model)
    jbad = out.pop("jbad")
    stopped = _check_json_rows(out, CITY)
    if model_name == "random":
        assert stopped >= 5  # most rows finish here, so the check is not vacuous
    # (stories260k loops on the unbounded integer's digits until max_new_tokens: every row says "length")
    if jbad["finish_reason"] == "stop":
        assert json.loads(jbad["text"])["n"] % 7 == 0


def test_schema_with_enum_and_bounds_on_random_model(random_models: dict[str, Path], tmp_path: Path) -> None:
    rows = [
        {
            "id": f"p{seed}",
            "prompt": "Describe a person:",
            "json_schema": json.dumps(PERSON),
            "temperature": 1.0,
            "seed": seed,
            "max_new_tokens": 80,
        }
        for seed in range(20)
    ]
    out = generate(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", random_models["qwen2"])
    assert _check_json_rows(out, PERSON) >= 10


def test_regex_and_ebnf_rows(random_models: dict[str, Path], tmp_path: Path) -> None:
    regex = r"[a-c]{2,4}-\d{3}"
    rows = [
        {"id": f"r{seed}", "prompt": "Code:", "regex": regex, "temperature": 1.0, "seed": seed, "max_new_tokens": 24}
        for seed in range(10)
    ]
    rows.append(
        {
            "id": "e",
            "prompt": "Answer:",
            "ebnf": 'root ::= "yes" | "no" | "maybe " ("so" | "not")',
            "temperature": 1.0,
            "seed": 3,
            "max_new_tokens": 12,
        }
    )
    out = generate(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", random_models["llama"])
    for i in range(10):
        row = out[f"r{i}"]
        assert row["finish_reason"] == "stop" and re.fullmatch(regex, row["text"]), row
    assert out["e"]["finish_reason"] == "stop" and out["e"]["text"] in {"yes", "no", "maybe so", "maybe not"}


# Strings an EBNF literal must escape, and one that is a prefix of another.
CHOICES = ["yes", "no", "no way", 'a "quoted" \\ one']


def test_choice_rows_are_one_of_the_strings_and_greedy_is_hfs(random_models: dict[str, Path], tmp_path: Path) -> None:
    """vLLM's guided_choice as a row's ``choice`` (found by a vLLM user: no way to give it): every sampled row's text
    is one of the strings, whole, ended by EOS; a greedy row's ids are HF float32's greedy ids under xgrammar's
    matcher of the grammar of the same strings written by hand; ``--choice`` gives every row one."""
    model = random_models["llama"]
    rows = [
        {"id": f"s{seed}", "prompt": "Answer:", "choice": CHOICES, "temperature": 1.0, "seed": seed}
        for seed in range(8)
    ]
    rows.append({"id": "g", "prompt": "Answer:", "choice": CHOICES, "temperature": 0})
    out = generate(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", model, "--max-new-tokens", "24")
    for row in out.values():
        assert row["finish_reason"] == "stop" and row["text"] in CHOICES, row
    ebnf = r'root ::= "yes" | "no" | "no way" | "a \"quoted\" \\ one"'
    assert out["g"]["output_token_ids"] == hf_constrained_greedy(model, "Answer:", ("ebnf", ebnf), [1], 24, {})
    dataset = write_jsonl(tmp_path / "r.jsonl", [{"id": f"r{seed}", "prompt": "x", "seed": seed} for seed in range(4)])
    out = generate(dataset, tmp_path / "r.arrow", model, "--choice", '["left", "right"]', "--temperature", "1")
    assert {row["text"] for row in out.values()} <= {"left", "right"}


def test_allowed_token_ids_greedy_is_hfs_argmax_among_them(random_models: dict[str, Path], tmp_path: Path) -> None:
    """vLLM's allowed_token_ids (found by a vLLM user: batchgen had none): a greedy row's ids are HF float32's argmax
    over the listed ids at every step, EOS left out so the row runs to its length; a sampled row and its n-gram
    speculative run draw only listed ids, the same ones."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = random_models["llama"]
    allowed = [5, 17, 40, 41, 99]
    rows = [
        {"id": "g", "prompt": "Answer:", "allowed_token_ids": allowed, "temperature": 0, "max_new_tokens": 8},
        {"id": "s", "prompt": "Answer:", "allowed_token_ids": allowed, "temperature": 1.0, "seed": 4},
    ]
    dataset = write_jsonl(tmp_path / "p.jsonl", rows)
    out = generate(dataset, tmp_path / "o.arrow", model, "--max-new-tokens", "12")
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = list(AutoTokenizer.from_pretrained(model)("Answer:")["input_ids"])
    for _ in range(8):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        ids.append(allowed[int(logits[allowed].argmax())])
    assert out["g"]["output_token_ids"] == ids[-8:] and out["g"]["finish_reason"] == "length"
    assert set(out["s"]["output_token_ids"]) <= set(allowed) and len(out["s"]["output_token_ids"]) == 12
    spec = ("--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "4", "--speculative-ngram-min", "1")
    speculated = generate(dataset, tmp_path / "n.arrow", model, "--max-new-tokens", "12", *spec)
    assert [speculated[k]["output_token_ids"] for k in "gs"] == [out[k]["output_token_ids"] for k in "gs"]


def test_run_level_constraint_flags_and_a_rows_own(random_models: dict[str, Path], tmp_path: Path) -> None:
    """``--json-schema`` / ``--regex`` / ``--ebnf`` give every row the constraint (a data-generation run over plain
    prompts; the CLI said "a row field" before, and Python calls had it per call); a row's own constraint of another
    kind replaces the run's, as its other fields do. Checked with jsonschema and ``re.fullmatch``."""
    rows = [{"id": f"j{seed}", "prompt": "Describe a person:", "seed": seed} for seed in range(8)]
    rows.append({"id": "own", "prompt": "Code:", "regex": r"[a-c]{2,4}-\d{3}", "seed": 1})
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"json-schema": PERSON}))  # a YAML mapping: the schema as an object
    sampled = ("--temperature", "1.0", "--max-new-tokens", "80")
    for given in (("--json-schema", json.dumps(PERSON)), ("--config", str(config))):
        out = generate(
            write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", random_models["qwen2"], *given, *sampled
        )
        own = out.pop("own")
        assert own["finish_reason"] == "stop" and re.fullmatch(r"[a-c]{2,4}-\d{3}", own["text"]), own
        assert _check_json_rows(out, PERSON) >= 4
    ebnf = 'root ::= "yes" | "no"'
    out = generate(
        write_jsonl(tmp_path / "e.jsonl", rows[:3]), tmp_path / "e.arrow", random_models["llama"], "--ebnf", ebnf
    )
    assert {row["text"] for row in out.values()} <= {"yes", "no"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--regex", "("], "Invalid value for '--regex': does not compile as a Python regular expression"),
        (["--json-schema", '{"type": "objectx"}'], "--json-schema: does not compile: Unsupported type"),
        (["--regex", "a", "--ebnf", 'root ::= "a"'], "--ebnf: give only one of json_schema, regex, ebnf, choice"),
        (["--choice", "yes"], "Invalid value for '--choice': must be an array of strings, got \"yes\""),
        (["--json-schema", "true"], "Invalid value for '--json-schema': must be a JSON schema object, got true"),
    ],
)
def test_a_bad_run_level_constraint_is_one_error_before_any_row(
    flags: list[str], message: str, random_models: dict[str, Path], tmp_path: Path
) -> None:
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}, {"prompt": "y"}])
    code, output = run_cli(run_args(dataset, tmp_path / "o.arrow", random_models["llama"], *flags))
    lines = [line for line in output.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], output


@pytest.mark.parametrize("flags", [["--json-schema", '{"type": "objectx"}'], ["--regex", r"a\bb"], ["--ebnf", "a"]])
def test_a_run_constraint_that_does_not_compile_is_refused_before_the_model_loads(
    flags: list[str], tmp_path: Path
) -> None:
    """Found by a review: it was compiled with the tokenizer, once the model had loaded (minutes for a large one),
    and ``batchgen status`` with it exited 1 (other settings) rather than 2 (invalid options). The model here does
    not exist: its error would come first were the constraint compiled after it."""
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    out = tmp_path / "o.arrow"
    code, output = run_cli(run_args(dataset, out, tmp_path / "no-model", *flags))
    assert code == 2 and f"{flags[0]}: does not compile: " in output and "no-model" not in output, output
    code, output = run_cli(["status", str(dataset), str(out), *flags])
    assert code == 2 and f"{flags[0]}: does not compile: " in output, output


def test_a_constraint_flag_replaces_a_config_files_other_kind(random_models: dict[str, Path], tmp_path: Path) -> None:
    """Flags override a ``--config`` file: ``--regex`` over the file's ``json-schema`` (found by a review: both
    were kept, and the run refused two constraints); in Python, ``run(config=..., regex=...)`` likewise."""
    import batchgen

    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"json-schema": PERSON, "max-new-tokens": 12, "dtype": "float32"}))
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Code:", "seed": 2}])
    out = generate(dataset, tmp_path / "o.arrow", random_models["llama"], "--config", str(config), "--regex", "[a-c]+")
    assert re.fullmatch("[a-c]+", out["a"]["text"]), out["a"]
    model = str(random_models["llama"])
    # On the CPU, as the command line's run (a CUDA device, the default where there is one, samples otherwise).
    options = {"model": model, "progress": False, "device": "cpu"}
    batchgen.run(dataset, tmp_path / "p.arrow", config=config, regex="[a-c]+", **options)
    assert read_rows(tmp_path / "p.arrow")["a"]["text"] == out["a"]["text"]


@needs_shared
def test_b11_emoji_regex_text_is_whole(tmp_path: Path) -> None:
    rows = [{"id": "emoji", "prompt": "Once upon a time", "regex": "🙂🙂 é", "max_new_tokens": 16, "temperature": 0}]
    out = generate(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", STORIES)["emoji"]
    assert out["text"] == "🙂🙂 é" and "\ufffd" not in out["text"]
    assert out["finish_reason"] == "stop"
    assert out["output_token_ids"][:4] == [243, 162, 156, 133]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("regex", "(", "field 'regex': does not compile"),
        ("json_schema", "{not json", "field 'json_schema': is not valid JSON"),
        ("ebnf", "root ::= ", "field 'ebnf': does not compile"),
        # xgrammar's log prefix (time, C++ file and line) is not part of the message.
        ("json_schema", '{"type": "objectx"}', "field 'json_schema': does not compile: Unsupported type"),
        # A keyword xgrammar would drop, nested: refused with its place (tests/unit/test_json_schema_support.py).
        (
            "json_schema",
            {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
            "field 'json_schema': uniqueItems at #/properties/tags is not enforced by xgrammar",
        ),
    ],
)
def test_bad_constraints_are_row_errors(
    field: str, value: Any, message: str, random_models: dict[str, Path], tmp_path: Path
) -> None:
    dataset = write_jsonl(
        tmp_path / "p.jsonl", [{"id": "bad", "prompt": "x", field: value}, {"id": "ok", "prompt": "x"}]
    )
    code, output = run_cli(
        run_args(dataset, tmp_path / "o.arrow", random_models["llama"], "--max-new-tokens", "2", "--no-progress")
    )
    assert code == 3 and f"p.jsonl:1: {message}" in output
    assert set(read_rows(tmp_path / "o.arrow")) == {"ok"}


def test_two_constraints_are_rejected(random_models: dict[str, Path], tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "regex": "a", "ebnf": 'root ::= "a"'}])
    code, output = run_cli(run_args(dataset, tmp_path / "o.arrow", random_models["llama"]))
    assert code == 3
    assert "field 'ebnf': give only one of json_schema, regex, ebnf, choice (found: regex, ebnf)" in output


def test_constraint_with_min_new_tokens_stays_valid(random_models: dict[str, Path], tmp_path: Path) -> None:
    rows = [
        {
            "id": f"r{t}",
            "prompt": "x",
            "regex": "a",
            "min_new_tokens": 5,
            "max_new_tokens": 10,
            "temperature": t,
            "seed": 1,
        }
        for t in (0, 1)
    ]
    out = generate(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", random_models["llama"])
    for row in out.values():
        assert row["text"] == "a" and row["finish_reason"] == "stop"


def test_schema_object_keeps_property_order(random_models: dict[str, Path], tmp_path: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"zeta": {"enum": [1]}, "alpha": {"enum": [2]}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    rows = [{"id": "o", "prompt": "x", "json_schema": schema, "max_new_tokens": 40, "temperature": 0}]
    out = generate(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", random_models["llama"])["o"]
    assert out["finish_reason"] == "stop" and list(json.loads(out["text"])) == ["zeta", "alpha"]
