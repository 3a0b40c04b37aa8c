"""The CLI keeps PyTorch's OpenMP threads spinning ($OMP_WAIT_POLICY=ACTIVE) unless the user chose a policy, and
only where it can still take effect: before torch (and with it libgomp) is loaded. Each case runs in a fresh
interpreter, since the variable matters only before that process imports torch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# A fresh process: the entry point's start-up step, then what libgomp would see, and whether torch was loaded.
_PROBE = """
import os, sys
{before}
from batchgen.environment import keep_openmp_threads_spinning
print(keep_openmp_threads_spinning(), os.environ.get("OMP_WAIT_POLICY"), "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    ("preset", "before", "expected"),
    [
        (None, "", "True ACTIVE False"),
        ("PASSIVE", "", "False PASSIVE False"),  # the user's choice wins
        (None, "import torch", "False None True"),  # too late: libgomp has read its environment
    ],
    ids=["set", "user-choice", "torch-already-loaded"],
)
def test_cli_start_keeps_openmp_threads_spinning(preset: str | None, before: str, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if preset is not None:
        env["OMP_WAIT_POLICY"] = preset
    result = subprocess.run(
        [sys.executable, "-c", _PROBE.format(before=before)], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


def test_the_entry_point_sets_it_before_importing_torch() -> None:
    """``python -m batchgen --help`` runs with the policy set: the CLI module reads it back as torch loads."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = (
        "import sys; sys.argv = ['batchgen', '--help']\n"
        "import batchgen.cli.entry as entry\n"
        "try:\n    entry.main()\nexcept SystemExit:\n    pass\n"
        "import os, torch; print('policy', os.environ.get('OMP_WAIT_POLICY'))"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "policy ACTIVE"
