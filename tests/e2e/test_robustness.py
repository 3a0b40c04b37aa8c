"""Findings of a new-user trial: signals keep the output readable, odd input never crashes the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io.partial_output import PartialOutput
from tests.helpers.cli import read_rows, run_args, run_cli, write_jsonl


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_leaves_a_readable_partial_output(
    sig: signal.Signals, random_models: dict[str, Path], tmp_path: Path
) -> None:
    rows = [
        {"id": f"r{i}", "prompt": "Once upon a time", "max_new_tokens": 200, "ignore_eos": True} for i in range(400)
    ]
    dataset = write_jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out.arrow"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batchgen",
            "run",
            str(dataset),
            "--out",
            str(out),
            "--model",
            str(random_models["llama"]),
            "--device",
            "cpu",
            "--no-progress",
            "--max-running-requests",
            "4",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    partial = PartialOutput(out)
    deadline = time.monotonic() + 60
    while not partial.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig.value, stderr
    assert f"stopped by {sig.name}" in stderr and "Traceback" not in stderr
    assert "batchgen: to resume: python -m batchgen run " in stderr and stderr.rstrip().endswith(" --resume")
    # The output file appears only complete; what finished is flushed to readable part files beside it.
    assert not out.exists()
    parts = partial.inspect().parts
    rows = [row for _, path in parts for row in pa.ipc.open_file(path).read_all().to_pylist()]
    assert len(rows) < 400
    for row in rows:
        assert row["finish_reason"] == "length" and len(row["output_token_ids"]) == 200


def test_a_prompt_that_is_not_unicode_is_a_row_error(random_models: dict[str, Path], tmp_path: Path) -> None:
    dataset = tmp_path / "p.jsonl"
    dataset.write_text(
        '{"id": "bad", "prompt": "bad \\ud800", "topic": "x"}\n{"id": "ok", "prompt": "hi", "topic": "y"}\n'
    )
    code, output = run_cli(
        run_args(
            dataset,
            tmp_path / "o.arrow",
            random_models["llama"],
            "--max-new-tokens",
            "2",
            "--on-error",
            "skip",
            "--ignore-eos",
            "--seed",
            "0",  # sampled: without them an early EOS could end the row (random run seed)
        )
    )
    assert code == 0, output
    rows = read_rows(tmp_path / "o.arrow")
    assert rows["bad"]["finish_reason"] == "error"
    assert rows["bad"]["error"].endswith(
        "field 'prompt': holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text"
    )
    assert rows["bad"]["topic"] == "x"  # error rows keep their pass-through fields
    assert rows["ok"]["completion_tokens"] == 2


def test_output_may_not_be_the_input(random_models: dict[str, Path], tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    before = dataset.read_text()
    code, output = run_cli(
        ["run", str(dataset), "--out", str(dataset), "--overwrite", "--model", str(random_models["llama"])]
    )
    assert code == 2 and "the output file is the input dataset" in output
    assert dataset.read_text() == before


def test_top_logprobs_without_logprobs_is_rejected(random_models: dict[str, Path], tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi", "logprobs": False, "top_logprobs": 2}])
    code, output = run_cli(run_args(dataset, tmp_path / "o.arrow", random_models["llama"]))
    assert code == 3 and "p.jsonl:1: field 'top_logprobs': needs logprobs: true" in output


def test_foreign_sampling_field_names_are_warned_about(random_models: dict[str, Path], tmp_path: Path) -> None:
    dataset = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {
                "prompt": "hi",
                "Temperature": 0,
                "best_of": 2,
                "response_format": {"type": "json_object"},
                "max_new_token": 9,
                "do_sample": False,
                "guided_json": {"type": "object"},
                "sampling_params": {"temperature": 0},
                "num_beams": 2,
                "category": "greeting",  # data, like none of the sampling fields: no warning
            }
        ],
    )
    # Sampled ('Temperature' is not read): --ignore-eos and --seed, so that no early EOS ends the row.
    extra = ("--max-new-tokens", "3", "--ignore-eos", "--seed", "0")
    code, output = run_cli(run_args(dataset, tmp_path / "o.jsonl", random_models["llama"], *extra))
    assert code == 0, output
    assert f"{dataset}:1: field 'Temperature' is not a sampling field (did you mean 'temperature'?)" in output
    assert "field 'best_of' is not supported: batchgen has no such option" in output
    assert "field 'response_format' is not read (a batchgen row gives its schema itself as 'json_schema'" in output
    assert "field 'max_new_token' is not a sampling field (did you mean 'max_new_tokens'?)" in output  # a near miss
    # Other engines' fields that a new user's rows carried with no word (HF's do_sample false, vLLM's guided_json,
    # SGLang's nested sampling_params): each row then ran sampled or unconstrained.
    assert "field 'do_sample' is not read (batchgen samples unless 'temperature' is 0: give temperature 0" in output
    assert "field 'guided_json' is not a sampling field (did you mean 'json_schema'?)" in output
    assert "field 'sampling_params' is not read (batchgen reads each sampling field at the top level" in output
    assert "field 'num_beams' is not supported: batchgen has no such option" in output
    assert "'category'" not in output
    row = json.loads((tmp_path / "o.jsonl").read_text())
    assert row["completion_tokens"] == 3 and row["category"] == "greeting"


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_openai_max_tokens_names_are_read_as_max_new_tokens(
    suffix: str, random_models: dict[str, Path], tmp_path: Path
) -> None:
    """A row written for OpenAI's API gets the length it asks for, not the default (found by a new user: it ran to
    128 tokens with a warning); a row without any of the names gets --max-new-tokens."""
    rows = [
        {"id": "a", "prompt": "hi", "max_tokens": 5, "max_completion_tokens": None},
        {"id": "b", "prompt": "hi", "max_tokens": None, "max_completion_tokens": 4},
        {"id": "c", "prompt": "hi", "max_tokens": None, "max_completion_tokens": None},
    ]
    dataset = tmp_path / f"p{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), dataset)
    else:
        write_jsonl(dataset, rows)
    extra = ("--max-new-tokens", "3", "--ignore-eos", "--temperature", "0")
    code, output = run_cli(run_args(dataset, tmp_path / "o.arrow", random_models["llama"], *extra))
    assert code == 0, output
    assert "warning" not in output
    got = read_rows(tmp_path / "o.arrow")
    assert {rid: row["completion_tokens"] for rid, row in got.items()} == {"a": 5, "b": 4, "c": 3}
    assert {rid: len(row["output_token_ids"]) for rid, row in got.items()} == {"a": 5, "b": 4, "c": 3}
    assert not {"max_tokens", "max_completion_tokens"} & set(got["a"])  # read, not passed through


def test_vllms_min_tokens_is_read_as_min_new_tokens(random_models: dict[str, Path], tmp_path: Path) -> None:
    """vLLM's ``min_tokens`` (its SamplingParams: the fewest tokens generated before EOS or ``stop_token_ids`` may end
    the output) holds back a stop id as ``min_new_tokens`` does (found by a vLLM user: it was warned about and
    ignored in a row, while an OpenAI request body's was read)."""
    extra = ("--max-new-tokens", "4", "--temperature", "0")
    dataset = write_jsonl(tmp_path / "first.jsonl", [{"id": "a", "prompt": "hi"}])
    assert run_cli(run_args(dataset, tmp_path / "first.arrow", random_models["llama"], *extra))[0] == 0
    first = read_rows(tmp_path / "first.arrow")["a"]["output_token_ids"][0]
    rows = [
        {"id": "stops", "prompt": "hi", "stop_token_ids": [first]},
        {"id": "min", "prompt": "hi", "stop_token_ids": [first], "min_tokens": 3},
        {"id": "min_new", "prompt": "hi", "stop_token_ids": [first], "min_new_tokens": 3},
    ]
    dataset = write_jsonl(tmp_path / "p.jsonl", rows)
    code, output = run_cli(run_args(dataset, tmp_path / "o.arrow", random_models["llama"], *extra))
    assert code == 0 and "warning" not in output, output
    got = read_rows(tmp_path / "o.arrow")
    assert got["stops"]["completion_tokens"] == 1 and got["stops"]["finish_reason"] == "stop"
    assert got["min"]["completion_tokens"] >= 3 and "min_tokens" not in got["min"]
    assert got["min"]["output_token_ids"] == got["min_new"]["output_token_ids"]


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "meta"])
def test_bad_device_is_one_line(device: str, random_models: dict[str, Path], tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    code, output = run_cli(run_args(dataset, tmp_path / "o.arrow", random_models["llama"], "--device", device))
    assert code == 2 and f"--device {device}: expected auto, cpu, cuda or cuda:N" in output
