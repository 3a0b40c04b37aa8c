"""How a ``messages`` row's prompt ends, as vLLM's chat requests choose it: the assistant's turn opened after the
messages (the default), neither, or the last message left open for the model to continue
(``continue_final_message``, a reply prefilled). The reference is Hugging Face's ``apply_chat_template`` with the
same arguments, which is what vLLM hands them to."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

import batchgen
from tests.helpers.chat import TOOL_TEMPLATE, with_chat_template
from tests.helpers.cli import run_args, run_cli, write_jsonl

CHAT = [{"role": "user", "content": "Name a planet."}, {"role": "assistant", "content": "The planet is"}]
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(random_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_chat_template(random_models["llama"], TOOL_TEMPLATE, tmp_path_factory.mktemp("end") / "llama")


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model)


def reference_ids(tokenizer: PreTrainedTokenizerBase, **arguments: Any) -> list[int]:
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, **arguments)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def test_each_prompt_end_prompts_as_hf_renders_it(model: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    ends = {
        "opened": ({}, {"add_generation_prompt": True}),
        "continued": ({"continue_final_message": True}, {"continue_final_message": True}),
        "neither": ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
    }
    references = {name: reference_ids(tokenizer, **hf) for name, (_, hf) in ends.items()}
    assert len({tuple(ids) for ids in references.values()}) == 3  # the check depends on each end
    assert tokenizer.decode(references["continued"]).endswith("The planet is")
    rows = [{"id": name, "messages": CHAT, **fields} for name, (fields, _) in ends.items()]
    rows += [{"id": f"{name}_ids", "prompt_token_ids": ids} for name, ids in references.items()]
    generator = batchgen.Generator(str(model), dtype="float32", device="cpu")
    got = {row["id"]: row for row in generator.generate(rows, **GREEDY)}
    for name, ids in references.items():
        assert got[name]["prompt_tokens"] == len(ids), name
        assert got[name]["output_token_ids"] == got[f"{name}_ids"]["output_token_ids"], name
        assert "continue_final_message" not in got[name] and "add_generation_prompt" not in got[name]  # read


def test_an_openai_batch_line_continues_its_last_message(
    model: Path, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    body = {"model": "m", "messages": CHAT, "add_generation_prompt": False, "continue_final_message": True}
    lines = [{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {**body, "max_tokens": 2}}]
    dataset = write_jsonl(tmp_path / "requests.jsonl", lines)
    code, output = run_cli(run_args(dataset, tmp_path / "out.jsonl", model))
    assert code == 0, output
    (line,) = map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())
    usage = line["response"]["body"]["usage"]["prompt_tokens"]
    assert usage == len(reference_ids(tokenizer, continue_final_message=True))
