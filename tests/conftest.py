"""Session set-up and shared fixtures; the helpers they use live in tests/helpers/."""

from __future__ import annotations

import os
import platform
from pathlib import Path

# Triton's CPU interpreter computes tl.dot with numpy's OpenBLAS. Its Haswell kernel (which OPENBLAS_CORETYPE=Haswell
# forces, as this workplace's machines set it) makes a row's float32 sums depend on the row's place in the matrix, so
# interpreted batch-invariant kernels would look batch-dependent; its Sandybridge kernel (AVX, on every x86-64 CPU in
# use) sums each row on its own. Set before numpy loads OpenBLAS, overriding the environment's.
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers.models import ARCH_CONFIGS, build_random_model

torch.set_num_threads(2)


# The thread count chosen, here and in the runs tests start as subprocesses: batchgen then does not warn that a busy
# machine (the test suite itself) slows it down, which would add a line to the output the tests compare.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def random_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch name → directory of a saved tiny random model."""
    root = tmp_path_factory.mktemp("models")
    return {arch: build_random_model(root / arch, arch) for arch in ARCH_CONFIGS}


@pytest.fixture
def every_draft_verified(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pin the draft budget to "verify every draft". Its round-cost fit is timed, so on a loaded machine it can
    hold drafts back, and tests that count accepted drafts would then vary between runs."""
    from batchgen.loop.round_cost import RoundCostModel

    monkeypatch.setattr(RoundCostModel, "break_even", lambda self, batch_size: 0.0)
