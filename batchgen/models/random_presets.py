"""``random:NAME`` models: a preset config from ``presets/NAME.json`` (beside this file; ``configs/models`` links
to it) with random weights, for benchmarks that need a model's shape but no download."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from batchgen.errors import BatchgenError

RANDOM_PREFIX = "random:"
# Inside the package, so that the presets ship in a built wheel too.
PRESETS_DIR = Path(__file__).with_name("presets")


def is_random_spec(spec: str) -> bool:
    return spec.startswith(RANDOM_PREFIX)


def random_preset_config(spec: str) -> Any:
    """The transformers config of preset ``random:NAME``.

    Raises:
        BatchgenError: no such preset (the message lists the available ones).
    """
    name = spec.removeprefix(RANDOM_PREFIX)
    path = PRESETS_DIR / f"{name}.json"
    if not path.is_file():
        available = sorted(p.stem for p in PRESETS_DIR.glob("*.json"))
        raise BatchgenError(f"unknown random model preset '{name}'; available: {', '.join(available) or 'none'}")
    data = json.loads(path.read_text())
    return AutoConfig.for_model(data.pop("model_type"), **data)
