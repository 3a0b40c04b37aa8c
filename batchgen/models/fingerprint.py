"""A cheap fingerprint of a model folder's files, so that ``--resume`` and ``batchgen status`` can tell a model
replaced at the same path (a retrained checkpoint, a ``latest`` link moved) from the one that wrote an output.

Each weights, config and tokenizer file is fingerprinted by its size and a SHA-256 of 16 slices of 64 KiB spread
evenly over it (the whole file up to 1 MiB): some 1 MiB of reads a file, where hashing a multi-GB checkpoint would
take seconds at every start. Fine-tuning, merging adapters or requantizing rewrites tensors all through a file, which
the slices see; an edit inside one tensor between two slices is what it may miss. Modification times are left out:
copying a model to another machine changes them and nothing else.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

# What decides a row's tokens: the weights, the architecture, the tokenizer and chat template. generation_config.json
# is left out: the sampling defaults it gives are compared field by field (batchgen.job.run_metadata).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_MODEL_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_SLICES = 16
_SLICE_BYTES = 1 << 16


def model_fingerprint(model_dir: Path) -> str:
    """The JSON object of each model file in ``model_dir`` (not its subfolders) → ``SIZE:SHA256`` of its slices,
    sorted by name; a file that cannot be read is left out (the loader says why it cannot be loaded)."""
    files = {}
    for path in sorted(model_dir.iterdir()):
        if path.name in _MODEL_FILES or path.suffix in _WEIGHT_SUFFIXES:
            try:
                files[path.name] = _file_fingerprint(path)
            except OSError:
                continue
    return json.dumps(files, sort_keys=True)


def fingerprint_differences(recorded: str | None, now: str | None) -> list[str]:
    """How the model's files changed from the ``recorded`` fingerprint to ``now``'s, as one phrase naming them;
    empty when none did, or when either has none (an output of a batchgen before fingerprints, a ``random:`` model:
    not compared)."""
    if recorded is None or now is None:
        return []
    try:
        old, new = json.loads(recorded), json.loads(now)
    except json.JSONDecodeError:
        return ["model files (unreadable fingerprint)"]
    changed = sorted(name for name in set(old) | set(new) if old.get(name) != new.get(name))
    if not changed:
        return []
    shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
    return [f"model files changed at the same path: {shown} (another checkpoint?)"]


def _file_fingerprint(path: Path) -> str:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest = hashlib.sha256()
        if size <= _SLICES * _SLICE_BYTES:
            digest.update(f.read())
        else:
            for i in range(_SLICES):
                f.seek((size - _SLICE_BYTES) * i // (_SLICES - 1))
                digest.update(f.read(_SLICE_BYTES))
    return f"{size}:{digest.hexdigest()}"
