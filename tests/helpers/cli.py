"""Run ``batchgen`` in-process and read its output rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def run_cli(args: list[str]) -> tuple[int, str]:
    """Run ``batchgen`` in this process; return (exit code, stderr + stdout)."""
    from batchgen.cli.app import app

    result = CliRunner().invoke(app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def read_rows(path: Path) -> dict[str, dict[str, Any]]:
    """Output rows by id."""
    from batchgen.io.writer import read_results

    return {r["id"]: r for r in read_results(path).to_pylist()}


def run_args(dataset: Path, out: Path, model: Path | str, *extra: str) -> list[str]:
    """Arguments of ``batchgen run`` in fp32 on CPU, overwriting ``out``."""
    return [
        "run",
        str(dataset),
        "--out",
        str(out),
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--no-progress",
        "--overwrite",
        *extra,
    ]


def generate(dataset: Path, out: Path, model: Path | str, *extra: str) -> dict[str, dict[str, Any]]:
    """``batchgen run`` in fp32 on CPU, asserting success; the rows by id."""
    code, output = run_cli(run_args(dataset, out, model, *extra))
    assert code == 0, output
    return read_rows(out)
