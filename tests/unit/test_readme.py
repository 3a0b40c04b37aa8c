"""The README's two commands are the ones CI runs, and a user's install takes no developer extras."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
VENV = "python3 -m venv .venv && . .venv/bin/activate && "


def _readme_command(section: str) -> str:
    """The one ```bash block under the README's ``## section`` heading."""
    body = (ROOT / "README.md").read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)\n```", body, re.S)
    assert len(blocks) == 1, f"README '{section}' should show one command, found {len(blocks)}"
    return str(blocks[0]).strip()


def _ci_commands() -> list[str]:
    """.ci/run's command lines, with pip's ``-q`` taken out (the README's commands show pip's progress)."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [line.replace("pip install -q ", "pip install ") for line in lines if line and not line.startswith("#")]


def test_ci_runs_the_readme_install_and_test_commands() -> None:
    install = _readme_command("Install and run")
    assert install.startswith(VENV)
    ci = _ci_commands()
    assert "python3 -m venv .venv" in ci
    assert install.removeprefix(VENV) in ci
    assert _readme_command("Test") in ci


def test_users_install_batchgen_without_the_developer_extras() -> None:
    install = _readme_command("Install and run")
    assert "pip install -e . " in install and "[dev]" not in install
    assert 'pip install -e ".[dev]"' in _readme_command("Test")


def test_readme_is_a_short_read() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
