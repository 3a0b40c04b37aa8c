"""The ``batchgen run`` command line: help, ``--config`` files, output formats and their metadata, pass-through
fields, chat rows, and the summary line."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.json as pajson
import pyarrow.parquet as pq
import pytest
import typer
from transformers import AutoTokenizer
from typer.testing import CliRunner

import batchgen
from batchgen.cli.app import app
from batchgen.io.writer import read_results
from tests.helpers.cli import run_cli, write_jsonl

COMMON = ["--dtype", "float32", "--device", "cpu", "--no-progress"]
SUMMARY = re.compile(
    r"^batchgen: (\d+) rows?(?: \(\d+ samples\))? done, (\d+) bad rows?, (\d+) prompt \+ (\d+) output tokens in "
    r"([\d.]+) s, ([\d.]+) output tok/s, (\d+) preemptions?(?:, prefix cache \d+ % of prompt tokens)?$"
)
# Every flag of `batchgen run`, as a user types it.
RUN_FLAGS = {
    "--out",
    "--prompt-column",
    "--messages-column",
    "--prompt-template",
    "--id-column",
    "--chat-template-kwargs",
    "-o",
    "--model",
    "--config",
    "--dtype",
    "--device",
    "--max-new-tokens",
    "--n",
    "--disable-cuda-graph",
    "--enable-cuda-graph",
    "--deterministic",
    "--no-deterministic",
    "--cuda-graph-max-bs",
    "--speculative-algorithm",
    "--speculative-num-draft-tokens",
    "--speculative-ngram-min",
    "--speculative-ngram-max",
    "--speculative-draft-model",
    "--speculative-acceptance",
    "--min-new-tokens",
    "--temperature",
    "--top-p",
    "--top-k",
    "--min-p",
    "--stop",
    "--stop-token-ids",
    "--bad-words",
    "--ignore-eos",
    "--no-ignore-eos",
    "--skip-special-tokens",
    "--no-skip-special-tokens",
    "--include-stop-str-in-output",
    "--no-include-stop-str-in-output",
    "--logprobs",
    "--no-logprobs",
    "--top-logprobs",
    "--seed",
    "--logprobs-mode",
    "--generation-config",
    "--json-schema",
    "--regex",
    "--ebnf",
    "--choice",
    "--truncate-prompt-tokens",
    "--prompt-logprobs",
    "--repetition-penalty",
    "--frequency-penalty",
    "--presence-penalty",
    "--context-length",
    "--max-total-tokens",
    "--mem-fraction",
    "--chunked-prefill-size",
    "--max-prefill-tokens",
    "--max-running-requests",
    "--attention-backend",
    "--prefix-cache",
    "--no-prefix-cache",
    "--schedule-lookahead",
    "--enable-mixed-chunk",
    "--disable-mixed-chunk",
    "--on-error",
    "--output-format",
    "--overwrite",
    "--no-overwrite",
    "--resume",
    "--no-resume",
    "--resume-force",
    "--no-resume-force",
    "--flush-every",
    "--flush-every-seconds",
    "--progress",
    "--no-progress",
    "--report-memory",
    "--no-report-memory",
    "--ray",
    "--no-ray",
    "--ray-address",
    "--replicas",
    "--gpus-per-replica",
    "--cpus-per-replica",
    "--ray-batch-rows",
    "--help",
}


def _run(dataset: Path, out: Path, model: Path, *extra: str) -> tuple[int, list[str]]:
    code, output = run_cli(["run", str(dataset), "--out", str(out), "--model", str(model), *COMMON, *extra])
    assert "Traceback" not in output, output
    return code, [line for line in output.splitlines() if line.strip()]


def _rows(table: pa.Table) -> list[dict[str, Any]]:
    return sorted(table.to_pylist(), key=lambda r: r["id"])


@pytest.fixture(scope="module")
def model(random_models: dict[str, Path]) -> Path:
    return random_models["llama"]


# --- help -------------------------------------------------------------------------------------------------


def test_run_command_has_exactly_the_documented_flags() -> None:
    command = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    flags = {flag for param in command.params for flag in (*param.opts, *param.secondary_opts) if flag.startswith("-")}
    flags.add("--help")
    assert flags == RUN_FLAGS


@pytest.mark.parametrize("columns", [80, 200])
def test_run_help_lists_every_option(columns: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # 80 columns is the usual terminal; every flag must be readable in full there, not cut to "--max-total-tok…".
    monkeypatch.setenv("COLUMNS", str(columns))
    result = CliRunner().invoke(app, ["run", "--help"])
    assert result.exit_code == 0, result.output
    shown = set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", result.output))
    assert sorted(RUN_FLAGS - shown) == []


@pytest.mark.parametrize(
    ("command", "usage"),
    [
        ("run", "[OPTIONS] DATASET --out OUT"),
        ("bench", "[OPTIONS] --model MODEL"),
        ("bench-one-batch", "[OPTIONS] --model MODEL"),
        ("status", "[OPTIONS] [DATASET] [OUT]"),  # or --config's dataset and out
    ],
)
def test_usage_line_names_the_required_options(command: str, usage: str) -> None:
    """``run``'s --out and the benchmarks' --model are required: the usage line says so, as it does arguments."""
    result = CliRunner().invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].endswith(f" {command} {usage}"), result.output.splitlines()[0]


def test_version() -> None:
    code, output = run_cli(["--version"])
    assert (code, output) == (0, f"batchgen {version('batchgen')}\n")
    # The console script answers it without importing torch (seconds).
    script = "import sys; sys.argv = ['batchgen', '--version']; from batchgen.cli.entry import main; main(); "
    script += "print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout == f"batchgen {version('batchgen')}\nFalse\n"


_CTRL_C_WHILE_IMPORTING = """
import importlib.abc, os, signal, sys
MODULE, SIGNAL = sys.argv.pop(1), signal.Signals[sys.argv.pop(1)]
class CtrlC(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == MODULE:  # a real signal, as a Ctrl-C or a scheduler sends it, while this module is imported
            os.kill(os.getpid(), SIGNAL)
sys.meta_path.insert(0, CtrlC())
from batchgen.cli.entry import main
main()
"""


@pytest.mark.parametrize(
    "module",
    [
        "transformers",  # the CLI's imports take seconds
        "typer._adapters",  # Typer reading the command line imports pydantic, and ends a KeyboardInterrupt silently
    ],
)
@pytest.mark.parametrize(
    ("sig", "line"),
    [
        (signal.SIGINT, "batchgen: interrupted while starting\n"),
        # Found by a new user: a scheduler's SIGTERM during start-up ended the process with no word.
        (signal.SIGTERM, "batchgen: stopped by SIGTERM while starting\n"),
    ],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_signal_while_the_cli_starts_is_one_line_and_its_exit_status(
    module: str, sig: signal.Signals, line: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _CTRL_C_WHILE_IMPORTING, module, sig.name, "run", "in.jsonl", "--out", "o.arrow"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert (result.returncode, result.stderr, result.stdout) == (128 + sig.value, line, "")


_SIGNAL_WHILE_LOADING = """
import os, signal, sys, time
from batchgen.loop import engine
SIGNAL = signal.Signals[sys.argv.pop(1)]
def load(*args, **kwargs):  # loading a model takes seconds; a Ctrl-C or SIGTERM lands there, before the job's handlers
    os.kill(os.getpid(), SIGNAL)
    time.sleep(60)
engine.Engine.__init__ = load
from batchgen.cli.entry import main
main()
"""


@pytest.mark.parametrize(
    ("sig", "line"),
    [
        (signal.SIGINT, "batchgen: interrupted while starting, before any row ran\n"),
        (signal.SIGTERM, "batchgen: stopped by SIGTERM while starting\n"),  # a scheduler's: it said no more
    ],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_signal_while_the_model_loads_is_one_line_and_its_exit_status(
    tmp_path: Path, sig: signal.Signals, line: str
) -> None:
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _SIGNAL_WHILE_LOADING,
            sig.name,
            "run",
            str(dataset),
            "--out",
            str(tmp_path / "o.arrow"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "2"},  # a chosen thread count: no busy-cores warning on a loaded CI
    )
    assert (result.returncode, result.stderr, result.stdout) == (128 + sig.value, line, "")
    assert not (tmp_path / "o.arrow").exists()


def test_python_m_batchgen_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "batchgen", "--help"], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "Offline batch generation for Hugging Face-format causal LMs." in result.stdout
    assert re.search(r"^\W*run\b", result.stdout, re.MULTILINE), result.stdout
    assert "Traceback" not in result.stderr


# --- --config ---------------------------------------------------------------------------------------------


def test_config_sets_defaults_and_flags_override_it(model: Path, tmp_path: Path) -> None:
    dataset = write_jsonl(
        tmp_path / "in.jsonl", [{"id": "a", "prompt": "Once upon a time"}, {"id": "b", "prompt": "The"}]
    )
    config = tmp_path / "run.yaml"
    # Keys as the long flags (dashes) or as Python names (underscores).
    config.write_text("max-new-tokens: 3\ntemperature: 0\nignore_eos: true\ntop-logprobs: 2\n")

    code, lines = _run(dataset, tmp_path / "config.arrow", model, "--config", str(config))
    assert code == 0, lines
    from_config = {r["id"]: r for r in pa.ipc.open_file(tmp_path / "config.arrow").read_all().to_pylist()}
    assert {rid: r["completion_tokens"] for rid, r in from_config.items()} == {"a": 3, "b": 3}
    assert all(len(r["top_logprobs"]) == 3 for r in from_config.values())

    code, lines = _run(dataset, tmp_path / "flag.arrow", model, "--config", str(config), "--max-new-tokens", "5")
    assert code == 0, lines
    table = pa.ipc.open_file(tmp_path / "flag.arrow").read_all()
    from_flag = {r["id"]: r for r in table.to_pylist()}
    assert {rid: r["completion_tokens"] for rid, r in from_flag.items()} == {"a": 5, "b": 5}
    # The rest of the config still applies: greedy (so the 5 tokens extend the 3), ignore_eos, top_logprobs 2.
    for rid in ("a", "b"):
        assert from_flag[rid]["output_token_ids"][:3] == from_config[rid]["output_token_ids"]
        assert all(len(step) == 2 for step in from_flag[rid]["top_logprobs"])
    defaults = json.loads(table.schema.metadata[b"batchgen.sampling_defaults"])
    assert (defaults["max_new_tokens"], defaults["temperature"], defaults["ignore_eos"], defaults["top_logprobs"]) == (
        5,
        0.0,
        True,
        2,
    )


def test_config_unknown_key_names_it(model: Path, tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    config = tmp_path / "c.yaml"
    config.write_text("max-new-tokens: 3\nmax_tokens: 3\n")
    code, output = run_cli(["run", str(dataset), "--out", str(tmp_path / "o.arrow"), "--config", str(config)])
    assert code == 2
    assert "unknown option 'max_tokens'" in " ".join(output.replace("│", " ").split())
    assert "Traceback" not in output
    assert not (tmp_path / "o.arrow").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--logprobs-mode", "foo"], "--logprobs-mode must be raw or processed, got 'foo'"),
        (["--speculative-algorithm", "eagle"], "--speculative-algorithm must be one of ngram, draft, got 'eagle'"),
        (["--dtype", "foo"], "unknown --dtype 'foo'; choose auto, "),
        (["--attention-backend", "foo"], "unknown attention backend 'foo'; choose one of "),
        (["--schedule-lookahead", "0"], "--schedule-lookahead must be >= 1, got 0"),
        (["--flush-every", "0"], "--flush-every must be >= 1, got 0"),
        # Found by a helper: -5 was a traceback, 0 the default, 1 a row error for every row.
        *((["--max-total-tokens", v], f"--max-total-tokens must be >= 2, got {v}") for v in ("-5", "0", "1")),
        (["--flush-every-seconds", "0"], "--flush-every-seconds must be > 0, got 0.0"),
        (["--ray", "--replicas", "0"], "--replicas must be >= 1, got 0"),
        (["--ray", "--cpus-per-replica", "0"], "--cpus-per-replica must be > 0, got 0.0"),
        (["--ray", "--gpus-per-replica", "-1"], "--gpus-per-replica must be >= 0, got -1.0"),
        (["--ray", "--ray-batch-rows", "0"], "--ray-batch-rows must be >= 1, got 0"),
        (["--replicas", "2"], "--replicas needs --ray"),
        (["--ray-address", "10.0.0.1:6379"], "--ray-address needs --ray"),
        (["--dtype", "yes"], "unknown --dtype 'yes'; choose auto, "),  # text, not a switch (found by a review)
        *(
            (["--chat-template-kwargs", value], f"Invalid value for '--chat-template-kwargs': {message}")
            for value, message in [
                ("[1]", "must be an object of template arguments, got array"),
                ('{"tokenize": true}', "'tokenize' is set by batchgen, not a template argument to give"),
                ("{enable_thinking: false}", "is not JSON: Expecting property name enclosed in double quotes"),
            ]
        ),
    ],
)
def test_a_bad_flag_is_named_before_the_existing_output(
    flags: list[str], message: str, model: Path, tmp_path: Path
) -> None:
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    out = tmp_path / "o.arrow"
    out.write_bytes(b"an earlier run's output")
    code, output = run_cli(["run", str(dataset), "--out", str(out), "--model", str(model), *flags])
    assert code == 2 and output.startswith(f"batchgen: error: {message}") and len(output.splitlines()) == 1


def test_another_commands_flag_keeps_clicks_list() -> None:
    """``bench`` has no --max-new-tokens: click's list of like flags, not a row's hint (found by a review: "is a row
    field")."""
    code, output = run_cli(["bench", "--max-new-tokens", "5"])
    assert code == 2 and "No such option: --max-new-tokens (Possible options: --max-prefill-tokens" in output


def test_config_null_keeps_the_default(model: Path, tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    config = tmp_path / "c.yaml"
    config.write_text("out: null\nmax-new-tokens: 2\nseed: null\n")
    out = tmp_path / "o.jsonl"
    code, output = run_cli(["run", str(dataset), "--out", str(out), "--model", str(model), "--config", str(config)])
    assert code == 0, output
    assert len(out.read_text().splitlines()) == 1


def test_config_bad_value_names_the_file(model: Path, tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    config = tmp_path / "c.yaml"
    config.write_text("max-new-tokens: 3\nmax-running-requests: many\n")
    code, output = run_cli(["run", str(dataset), "--out", str(tmp_path / "o.arrow"), "--config", str(config)])
    assert (code, output) == (
        2,
        f"batchgen: error: {config}: option 'max-running-requests': must be an integer, got \"many\"\n",
    )
    # A near spelling, or vLLM's name, of a key is suggested (found by a new user: no "did you mean" there).
    for key, meant in [
        ("max-new-token", "max-new-tokens"),
        ("max_tokens", "max-new-tokens"),
        ("temprature", "temperature"),
    ]:
        config.write_text(f"{key}: 3\n")
        code, output = run_cli(["run", str(dataset), "--out", str(tmp_path / "o.arrow"), "--config", str(config)])
        assert (code, output) == (2, f"batchgen: error: {config}: unknown option '{key}' (did you mean '{meant}'?)\n")


@pytest.mark.parametrize(
    ("line", "option", "shown"),
    [
        ("max-new-tokens: true", "max-new-tokens", "true"),
        ("temperature: false", "temperature", "false"),
        ("model: true", "model", "true"),
        ("stop: [x, true]", "stop", '["x", true]'),
        ("stop: true", "stop", "true"),
    ],
)
def test_config_true_or_false_is_not_a_number_or_a_string(
    line: str, option: str, shown: str, model: Path, tmp_path: Path
) -> None:
    """YAML's true/false where an option takes numbers or strings (click would read true as 1 or "True")."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    config = tmp_path / "c.yaml"
    config.write_text(line + "\n")
    out = tmp_path / "o.jsonl"
    code, output = run_cli(["run", str(dataset), "--out", str(out), "--model", str(model), "--config", str(config)])
    assert code == 2 and not out.exists()
    assert output == f"batchgen: error: {config}: option '{option}': takes no true/false value, got {shown}\n"


@pytest.mark.parametrize(("line", "shown"), [("stop: 5", "5"), ("stop: [x, 2.5]", '["x", 2.5]')])
def test_config_number_is_not_text(line: str, shown: str, model: Path, tmp_path: Path) -> None:
    """A YAML number where an option takes text (click would read 5 as the stop string "5"; a row's stop of 5 is a
    bad row); quoted, it is the text."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    config = tmp_path / "c.yaml"
    config.write_text(line + "\n")
    out = tmp_path / "o.jsonl"
    run = ["run", str(dataset), "--out", str(out), "--model", str(model), "--config", str(config)]
    code, output = run_cli(run)
    assert code == 2 and not out.exists()
    assert output == (
        f"batchgen: error: {config}: option 'stop': takes text, got {shown} (quote a value meant as text)\n"
    )
    config.write_text("stop: '5'\nmax-new-tokens: 1\ndevice: cpu\n")
    assert run_cli(run)[0] == 0


def test_stop_flag_escapes(model: Path, tmp_path: Path) -> None:
    """--stop '\\n' on a command line is a newline (a shell passes the backslash and the n), as in --prompt-template;
    '\\\\n' is the backslash and the n; a config file's single-quoted '\\n' too. The recorded defaults show it."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    config = tmp_path / "c.yaml"
    config.write_text("stop: ['\\n', 'a\\tb']\n")
    for extra, want in [
        (["--stop", "\\n", "--stop", "\\\\n"], ["\n", "\\n"]),
        (["--config", str(config)], ["\n", "a\tb"]),
        (["--stop=--no-progress"], ["--no-progress"]),
    ]:
        out = tmp_path / f"o{len(extra)}{extra[0][:3]}.arrow"
        run = ["run", str(dataset), "--out", str(out), "--model", str(model), "--device", "cpu"]
        assert run_cli([*run, "--max-new-tokens", "1", *extra])[0] == 0
        metadata = read_results(out).schema.metadata or {}
        assert json.loads(metadata[b"batchgen.sampling_defaults"])["stop"] == want


@pytest.mark.parametrize(
    ("command", "given", "flag", "value", "long"),
    [
        ("run", [], "--stop", "--no-progress", "--stop"),
        ("run", [], "-o", "--overwrite", "--out"),  # `-o=X` would be the value "=X": the hint names --out
        ("run", ["--stop", "--"], "--prompt-column", "--no-progress", "--prompt-column"),  # `--` as a value
        ("bench", [], "--dataset", "--baseline=hf", "--dataset"),
    ],
)
def test_a_flag_is_no_value_of_the_flag_before_it(
    tmp_path: Path, command: str, given: list[str], flag: str, value: str, long: str
) -> None:
    """As argparse refuses it (vLLM's commands): a flag that takes a value followed by another of the command's flags
    is a usage error, not the value (click took ``--stop --no-progress`` as the stop string)."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    out = [] if command == "bench" or long == "--out" else ["--out", str(tmp_path / "o.arrow")]
    head = ["run", str(dataset), *out] if command == "run" else ["bench", "--model", "m"]
    code, output = run_cli([*head, *given, flag, value])
    assert code == 2
    assert f"Option '{flag}' requires an argument, got the flag '{value}' (write {long}={value} if" in output
    assert not (tmp_path / "o.arrow").exists()


@pytest.mark.parametrize(
    ("line", "flag", "error"),
    [
        ("dtype: bfloat17", "--dtype=bfloat17", "unknown --dtype 'bfloat17'; choose auto, float32, bfloat16, float16"),
        ("device: tpu", "--device=tpu", "--device tpu: expected auto, cpu, cuda or cuda:N"),
        ("mem-fraction: 2", "--mem-fraction=2", "--mem-fraction must be in (0, 1), got 2.0"),
        ("top_p: 1.5", "--top-p=1.5", "--top-p: must be in (0, 1], got 1.5"),
    ],
)
def test_config_value_out_of_range_names_the_file_and_a_flag_does_not(
    line: str, flag: str, error: str, model: Path, tmp_path: Path
) -> None:
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    config = tmp_path / "c.yaml"
    out = tmp_path / "o.jsonl"
    base = ["run", str(dataset), "--out", str(out), "--model", str(model), "--config", str(config)]
    option = flag.removeprefix("--").split("=")[0]
    config.write_text(line + "\n")
    code, output = run_cli(base)
    assert code == 2 and not out.exists()
    assert output == f"batchgen: error: {config}: option '{option}': {error.removeprefix(f'--{option}: ')}\n"
    config.write_text("max-new-tokens: 2\n")
    code, output = run_cli([*base, flag])
    assert (code, output) == (2, f"batchgen: error: {error}\n")


def test_config_takes_one_value_of_a_repeatable_option(model: Path, tmp_path: Path) -> None:
    """``stop: "x"`` in a config, as ``"stop": "x"`` on a row, is the list of that one string."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": [0, 5], "max_new_tokens": 4}])
    config = tmp_path / "c.yaml"
    out = tmp_path / "o.jsonl"
    base = ["run", str(dataset), "--out", str(out), "--model", str(model), "--overwrite", "--config", str(config)]
    config.write_text("temperature: 0\nignore-eos: true\n")
    assert run_cli(base)[0] == 0
    first = json.loads(out.read_text())["output_token_ids"][0]
    config.write_text(f"temperature: 0\nignore-eos: true\nstop-token-ids: {first}\n")
    code, output = run_cli(base)
    assert code == 0, output
    row = json.loads(out.read_text())
    assert row["output_token_ids"] == [first] and row["matched_stop"] == str(first)


def test_config_true_or_false_sets_a_switch(model: Path, tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x", "max_new_tokens": 2}])
    config = tmp_path / "c.yaml"
    config.write_text("ignore-eos: true\nprogress: false\n")
    out = tmp_path / "o.jsonl"
    code, output = run_cli(["run", str(dataset), "--out", str(out), "--model", str(model), "--config", str(config)])
    assert code == 0, output
    assert json.loads(out.read_text())["completion_tokens"] == 2


@pytest.mark.parametrize("key", ["resume", "resume-force"])
def test_a_config_that_resumes_is_overridden_by_a_flag(key: str, model: Path, tmp_path: Path) -> None:
    """Flags override the config (options.md), a switch the config turns on too: --overwrite starts a config's
    resuming run over (a helper: it was an error naming the file's resume, though refusals of a changed run say to
    pass --overwrite), as --no-resume / --no-resume-force do (helper 63); on the command line both still exclude each
    other. The row ignores EOS: an unseeded run's sampled first token was EOS once in a CI run."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x", "max_new_tokens": 2, "ignore_eos": True}])
    config = tmp_path / "c.yaml"
    config.write_text(f"{key}: true\n")
    out = tmp_path / "o.jsonl"
    for flags in (["--overwrite"], ["--overwrite", f"--no-{key}"]):
        out.write_text("an earlier output\n")
        code, output = _run(dataset, out, model, "--config", str(config), *flags)
        assert code == 0, output
        assert json.loads(out.read_text())["completion_tokens"] == 2
    code, output = _run(dataset, out, model, "--config", str(config), "--overwrite", f"--{key}")
    assert (code, output) == (
        2,
        [f"batchgen: error: --overwrite and --{key} exclude each other: --overwrite starts over, --{key} continues"],
    )
    # And a config's overwrite under a --resume flag: the flag's resume, not the file's start over.
    config.write_text("overwrite: true\n")
    code, output = _run(dataset, out, model, "--config", str(config), f"--{key}")
    assert code == 0 and out.read_text().count("\n") == 1, output


# --- output formats and metadata --------------------------------------------------------------------------

FORMAT_ROWS = [
    {"id": "a", "prompt": "Once upon a time"},
    {"id": "b", "prompt_token_ids": [0, 45, 71, 80, 90], "max_new_tokens": 3},
    {"id": "c", "prompt": "Café, naïve and jalapeño", "top_logprobs": 1},
]
FORMAT_FLAGS = [
    "--max-new-tokens",
    "4",
    "--temperature",
    "0",
    "--top-p",
    "0.9",
    "--top-k",
    "5",
    "--min-p",
    "0.05",
    "--ignore-eos",
    "--top-logprobs",
    "2",
]


@pytest.fixture(scope="module")
def formats(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same dataset and flags written as .arrow, .parquet and .jsonl."""
    work = tmp_path_factory.mktemp("formats")
    dataset = write_jsonl(work / "in.jsonl", FORMAT_ROWS)
    outs = {}
    for suffix in ("arrow", "parquet", "jsonl"):
        out = work / f"out.{suffix}"
        code, lines = _run(dataset, out, model, *FORMAT_FLAGS)
        assert code == 0, lines
        outs[suffix] = out
    return outs


def test_output_formats_hold_the_same_rows(formats: dict[str, Path]) -> None:
    arrow = pa.ipc.open_file(formats["arrow"]).read_all()
    parquet = pq.read_table(formats["parquet"])
    jsonl = pajson.read_json(formats["jsonl"])
    assert parquet.schema.names == arrow.schema.names
    assert set(jsonl.schema.names) == set(arrow.schema.names)
    assert len(formats["jsonl"].read_text().splitlines()) == 3
    rows = _rows(arrow)
    assert _rows(parquet) == rows
    assert _rows(jsonl) == rows
    # Concrete content: flags as defaults, row fields win; greedy, so the chosen token is the raw top-1.
    assert [(r["id"], r["completion_tokens"], r["finish_reason"]) for r in rows] == [
        ("a", 4, "length"),
        ("b", 3, "length"),
        ("c", 4, "length"),
    ]
    assert [r["prompt_tokens"] for r in rows][1] == 5
    for r in rows:
        assert len(r["output_token_ids"]) == len(r["output_logprobs"]) == r["completion_tokens"]
        assert [len(step) for step in r["top_logprobs"]] == [1 if r["id"] == "c" else 2] * r["completion_tokens"]
        assert [step[0]["id"] for step in r["top_logprobs"]] == r["output_token_ids"]
        assert [step[0]["logprob"] for step in r["top_logprobs"]] == pytest.approx(r["output_logprobs"], abs=1e-6)
        assert r["error"] is None and r["matched_stop"] is None


def test_arrow_and_parquet_schema_metadata(formats: dict[str, Path], model: Path) -> None:
    expected_defaults = {
        "max_new_tokens": 4,
        "min_new_tokens": 0,
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.05,
        "stop": [],
        "stop_token_ids": [],
        "bad_words": [],
        "ignore_eos": True,
        "seed": None,
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
        "logprobs": True,
        "top_logprobs": 2,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "logit_bias": [],
        "allowed_token_ids": None,
        "json_schema": None,
        "regex": None,
        "ebnf": None,
        "choice": None,
        "prompt_logprobs": None,
        "prompt_logprobs_from": None,
        "truncate_prompt_tokens": None,
        "n": 1,
    }
    for schema in (pa.ipc.open_file(formats["arrow"]).schema, pq.read_schema(formats["parquet"])):
        meta = {k.decode(): v.decode() for k, v in schema.metadata.items()}
        assert meta["batchgen.model"] == str(model)
        assert meta["batchgen.dtype"] == "float32"
        assert meta["batchgen.version"] == batchgen.__version__ == version("batchgen")
        assert meta["batchgen.logprobs_mode"] == "raw"
        assert json.loads(meta["batchgen.sampling_defaults"]) == expected_defaults


# --- pass-through fields ----------------------------------------------------------------------------------


def test_passthrough_fields_come_back_unchanged(model: Path, tmp_path: Path) -> None:
    rows = [
        {
            "id": "a",
            "prompt": "Once upon a time",
            "source": "wiki",
            "count": 7,
            "nested": [[1, 2], [3]],
            "meta": {"k": "v", "x": 1.5},
            "text": "original",
        },
        {
            "id": 42,
            "prompt": "The",
            "source": "news",
            "count": -3,
            "nested": [[], [4, 5, 6]],
            "meta": {"k": "w", "x": 0.0},
        },
        {"id": "c", "prompt": "The"},
    ]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    code, lines = _run(dataset, tmp_path / "out.arrow", model, "--max-new-tokens", "2", "--temperature", "0")
    assert code == 0, lines
    table = pa.ipc.open_file(tmp_path / "out.arrow").read_all()
    got = {r["id"]: r for r in table.to_pylist()}
    assert sorted(got) == ["42", "a", "c"]
    fields = ("source", "count", "nested", "meta", "input_text")
    assert [got["a"][f] for f in fields] == ["wiki", 7, [[1, 2], [3]], {"k": "v", "x": 1.5}, "original"]
    assert [got["42"][f] for f in fields] == ["news", -3, [[], [4, 5, 6]], {"k": "w", "x": 0.0}, None]
    assert [got["c"][f] for f in fields] == [None] * 5
    # `text` is an output column: the input's `text` comes back as `input_text`, the generated text stays `text`.
    assert got["a"]["text"] != "original" and got["a"]["completion_tokens"] == 2
    assert table.schema.field("count").type == pa.int64()
    assert table.schema.field("nested").type == pa.list_(pa.list_(pa.int64()))


def test_passthrough_fields_first_seen_after_a_thousand_rows_keep_their_values(model: Path, tmp_path: Path) -> None:
    """The JSONL schema comes from every row: a field first seen in row 1,050 and an object key first seen in row
    1,060 get their columns, typed as pyarrow types the same values read all at once, and every row is written."""
    rows: list[dict[str, Any]] = [{"prompt": "The", "meta": {"k": i}} for i in range(1100)]
    rows[1050]["source"] = "late"
    rows[1060]["meta"] = {"k": 1060, "added": "x"}
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    code, lines = _run(dataset, tmp_path / "out.arrow", model, "--max-new-tokens", "1", "--temperature", "0")
    assert code == 0, lines
    table = pa.ipc.open_file(tmp_path / "out.arrow").read_all()
    expected = pa.Table.from_pylist([{"meta": row["meta"], "source": row.get("source")} for row in rows])
    assert table.num_rows == len(rows)
    for column in ("meta", "source"):
        assert table.schema.field(column).type == expected.schema.field(column).type
        by_id = dict(zip(table.column("id").to_pylist(), table.column(column).to_pylist(), strict=True))
        assert [by_id[str(i)] for i in range(len(rows))] == expected.column(column).to_pylist()


def test_a_json_text_column_holds_the_values_themselves_in_a_jsonl_output(model: Path, tmp_path: Path) -> None:
    """Values that share no Arrow type pass through as JSON text in Arrow and Parquet; a .jsonl output, whose
    values may differ in type, writes each value as the input row had it (found by a helper: a boolean came back as
    the string "true"). The warning that a field passes as JSON text comes with the Arrow output only (found by a
    helper: it came with a .jsonl output too)."""
    values = [True, 1, 1.5, {"x": {"y": 1}}, "s", None, [1, "a"]]
    rows = [{"id": str(i), "prompt": "The", "flag": value} for i, value in enumerate(values)]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    flags = ("--max-new-tokens", "1", "--temperature", "0")
    warning = f"batchgen: warning: {dataset}: field 'flag': no one type stores all its values unchanged"
    code, output = _run(dataset, tmp_path / "out.jsonl", model, *flags)
    assert code == 0 and not any(line.startswith(warning) for line in output)
    code, output = _run(dataset, tmp_path / "out.arrow", model, *flags)
    assert code == 0 and any(line.startswith(warning) for line in output)
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert {line["id"]: line["flag"] for line in lines} == {row["id"]: row["flag"] for row in rows}
    table = pa.ipc.open_file(tmp_path / "out.arrow").read_all()
    texts = dict(zip(table.column("id").to_pylist(), table.column("flag").to_pylist(), strict=True))
    assert texts == {row["id"]: None if row["flag"] is None else json.dumps(row["flag"]) for row in rows}


# --- chat rows --------------------------------------------------------------------------------------------

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_messages_use_the_chat_template(model: Path, tmp_path: Path) -> None:
    chat_model = tmp_path / "chat_model"
    shutil.copytree(model, chat_model)
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(chat_model)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once upon a time"}]
    rendered = "<s>system: Be brief.\nuser: Once upon a time\nassistant:"
    expected_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert expected_ids[0] == 0 and expected_ids.count(0) == 1  # the template's BOS, once
    params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    rows = [{"id": "chat", "messages": messages, **params}, {"id": "ids", "prompt_token_ids": expected_ids, **params}]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    code, lines = _run(dataset, tmp_path / "out.arrow", chat_model)
    assert code == 0, lines
    got = {r["id"]: r for r in pa.ipc.open_file(tmp_path / "out.arrow").read_all().to_pylist()}
    assert got["chat"]["prompt_tokens"] == len(expected_ids) == got["ids"]["prompt_tokens"]
    assert got["chat"]["completion_tokens"] == 5
    assert got["chat"]["output_token_ids"] == got["ids"]["output_token_ids"]
    assert got["chat"]["text"] == got["ids"]["text"]


def test_chat_template_kwargs_flag_sets_every_messages_rows_template_arguments(model: Path, tmp_path: Path) -> None:
    """``--chat-template-kwargs`` (vLLM's ``LLM.chat(chat_template_kwargs=...)`` for a whole run): each messages row
    renders as transformers' ``apply_chat_template`` renders it with those arguments, a row's own
    ``chat_template_kwargs`` adding to them and winning; a prompt row is not rendered and runs as it is."""
    chat_model = tmp_path / "chat_model"
    shutil.copytree(model, chat_model)
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.chat_template = CHAT_TEMPLATE + "{% if not enable_thinking %} quick{% endif %}{{ tone or '' }}"
    tokenizer.save_pretrained(chat_model)
    messages = [{"role": "user", "content": "Once upon a time"}]

    def ids(**kwargs: Any) -> list[int]:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])

    run_level, own = ids(enable_thinking=False, tone=" calm"), ids(enable_thinking=False, tone=" warm")
    assert len({tuple(run_level), tuple(own), tuple(ids(enable_thinking=True))}) == 3
    rows = [
        {"id": "run", "messages": messages},
        {"id": "own", "messages": messages, "chat_template_kwargs": {"tone": " warm"}},
        {"id": "prompt", "prompt": "Once upon a time"},
        {"id": "run_ids", "prompt_token_ids": run_level},
        {"id": "own_ids", "prompt_token_ids": own},
    ]
    dataset = write_jsonl(tmp_path / "in.jsonl", [{**row, "max_new_tokens": 3, "temperature": 0} for row in rows])
    kwargs = '{"enable_thinking": false, "tone": " calm"}'
    code, lines = _run(dataset, tmp_path / "out.arrow", chat_model, "--chat-template-kwargs", kwargs)
    assert code == 0, lines
    got = {r["id"]: r for r in pa.ipc.open_file(tmp_path / "out.arrow").read_all().to_pylist()}
    for row, reference in (("run", run_level), ("own", own)):
        assert got[row]["prompt_tokens"] == len(reference)
        assert got[row]["output_token_ids"] == got[f"{row}_ids"]["output_token_ids"]
    assert got["prompt"]["completion_tokens"] == 3


def test_a_prompt_that_tokenizes_beyond_the_models_vocabulary_is_a_bad_row(model: Path, tmp_path: Path) -> None:
    """Found by a tester: a tokenizer given a special token the model was not resized for (a fine-tune's added
    token) tokenized a prompt to an id past the embedding, and the whole run crashed in the embedding lookup with a
    traceback, writing nothing. That row is now a bad row, as a ``prompt_token_ids`` id outside the vocabulary is."""
    extra_model = tmp_path / "extra_model"
    shutil.copytree(model, extra_model)
    tokenizer = AutoTokenizer.from_pretrained(extra_model)
    vocab = len(tokenizer)  # the random model's vocabulary is its tokenizer's
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    tokenizer.save_pretrained(extra_model)
    rows = [
        # Sampled and unseeded: ignore_eos keeps an early EOS from leaving it one token.
        {"id": "good", "prompt": "Once upon a time", "max_new_tokens": 2, "ignore_eos": True},
        {"id": "bad", "prompt": "Hi <|extra|>"},
        {"id": "scored", "prompt": "Once upon", "continuation": " a <|extra|>"},
    ]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    code, lines = _run(dataset, tmp_path / "out.arrow", extra_model)
    assert code == 3, lines
    message = f"tokenizes to id {vocab} ('<|extra|>'), outside the model's vocabulary [0, {vocab})"
    assert f"batchgen: error: {dataset}:2: field 'prompt': {message}" in lines
    assert f"batchgen: error: {dataset}:3: field 'continuation': {message}" in lines  # where the id is
    got = pa.ipc.open_file(tmp_path / "out.arrow").read_all().to_pylist()
    assert [(r["id"], r["completion_tokens"]) for r in got] == [("good", 2)]


def test_messages_without_chat_template_is_a_row_error(model: Path, tmp_path: Path) -> None:
    rows = [
        {"id": "good", "prompt": "Once upon a time", "max_new_tokens": 2, "ignore_eos": True},  # sampled, unseeded
        {"id": "chat", "messages": [{"role": "user", "content": "hi"}]},
    ]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    code, lines = _run(dataset, tmp_path / "out.arrow", model)
    assert code == 3
    assert (
        f"batchgen: error: {dataset}:2: field 'messages': the model's tokenizer has no chat template; "
        "give a plain prompt instead"
    ) in lines
    got = pa.ipc.open_file(tmp_path / "out.arrow").read_all().to_pylist()
    assert [(r["id"], r["completion_tokens"]) for r in got] == [("good", 2)]


# --- summary line -----------------------------------------------------------------------------------------


def test_summary_line_counts_requests_and_tokens(model: Path, tmp_path: Path) -> None:
    text_prompt_tokens = len(AutoTokenizer.from_pretrained(model)("Once upon a time")["input_ids"])
    assert text_prompt_tokens == 6  # BOS + 5
    rows = [
        {"id": "a", "prompt_token_ids": [0, 5, 6], "max_new_tokens": 3},
        {"id": "b", "prompt_token_ids": [0, 7, 8, 9], "max_new_tokens": 4},
        {"id": "c", "prompt": "Once upon a time", "max_new_tokens": 5},
    ]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    code, lines = _run(dataset, tmp_path / "out.arrow", model, "--ignore-eos", "--temperature", "0")
    assert code == 0, lines
    assert len(lines) == 1, lines
    match = SUMMARY.match(lines[0])
    assert match, lines[0]
    n, errors, prompt, output, seconds, rate, preemptions = match.groups()
    assert (int(n), int(errors), int(prompt), int(output), int(preemptions)) == (3, 0, 3 + 4 + 6, 3 + 4 + 5, 0)
    got = pa.ipc.open_file(tmp_path / "out.arrow").read_all().to_pylist()
    assert sum(r["completion_tokens"] for r in got) == int(output)
    assert sum(r["prompt_tokens"] for r in got) == int(prompt)
    assert float(rate) > 0.0


def test_report_memory_prints_peak_rss(random_models: dict[str, Path], tmp_path: Path) -> None:
    import re

    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi", "max_new_tokens": 1}])
    code, output = run_cli(
        [
            "run",
            str(dataset),
            "--out",
            str(tmp_path / "o.arrow"),
            "--model",
            str(random_models["llama"]),
            "--report-memory",
            *COMMON,
        ]
    )
    assert code == 0, output
    match = re.search(r"batchgen: peak RSS (\d+) MiB", output)
    assert match is not None and 50 < int(match.group(1)) < 24 * 1024


@pytest.mark.parametrize(
    ("load", "threads_variable", "warned"), [(8.5, None, True), (1.5, None, False), (8.5, "2", False)]
)
def test_a_busy_machine_is_said_once(
    load: float,
    threads_variable: str | None,
    warned: bool,
    random_models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 1-minute load average above the 2 threads the tests compute with (conftest) takes cores this run counts
    on: one line says so and names OMP_NUM_THREADS; not below it, nor when OMP_NUM_THREADS chose the count."""
    import os

    monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.0, 0.0))
    if threads_variable is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", threads_variable)
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi", "max_new_tokens": 1}] * 3)
    code, lines = _run(dataset, tmp_path / "o.arrow", random_models["llama"])
    assert code == 0, lines
    warnings = [line for line in lines if "load average" in line]
    if warned:
        assert warnings == [
            "batchgen: warning: the load average is 8.5, above the 2 cores batchgen computes on: other processes "
            "compete for them and this run will be slower (set OMP_NUM_THREADS to the idle cores)"
        ]
    else:
        assert warnings == []
    assert SUMMARY.match(lines[-1]), lines


def test_summary_line_counts_in_the_number_each_count_takes() -> None:
    from batchgen.job.summary import RunSummary

    one = RunSummary(samples=1, rows=1, errors=1, prompt_tokens=3, output_tokens=2, seconds=2.0, preemptions=1)
    assert (
        one.line()
        == "batchgen: 1 row done, 1 bad row, 3 prompt + 2 output tokens in 2.0 s, 1.0 output tok/s, 1 preemption"
    )
    two = RunSummary(samples=2, rows=2, errors=0, prompt_tokens=3, output_tokens=4, seconds=2.0, preemptions=0)
    assert (
        two.line()
        == "batchgen: 2 rows done, 0 bad rows, 3 prompt + 4 output tokens in 2.0 s, 2.0 output tok/s, 0 preemptions"
    )


def test_summary_line_counts_rows_and_their_samples(model: Path, tmp_path: Path) -> None:
    """10 rows with n = 3 are 10 rows and 30 samples, not "30 requests" (found by a new user)."""
    rows = [{"id": str(i), "prompt_token_ids": [0, 5 + i], "max_new_tokens": 2, "n": 3} for i in range(10)]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    code, lines = _run(dataset, tmp_path / "out.arrow", model, "--ignore-eos", "--seed", "0")
    assert code == 0, lines
    assert lines[0].startswith("batchgen: 10 rows (30 samples) done, 0 bad rows, 20 prompt + 60 output tokens in ")
    assert SUMMARY.match(lines[0]), lines[0]
    assert len(pa.ipc.open_file(tmp_path / "out.arrow").read_all()) == 30


def test_another_tools_command_names_batchgens() -> None:
    """Found by a vLLM user: ``batchgen run-batch -i ... -o ...`` said only "No such command"."""
    code, output = run_cli(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl"])
    assert code == 2 and "No such command 'run-batch' (vLLM's run-batch: batchgen run REQUESTS.jsonl --out" in output
