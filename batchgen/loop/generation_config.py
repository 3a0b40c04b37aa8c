"""What a model's ``generation_config.json`` tells a run: the ids that end a row, and the sampling defaults its
creator recommends (``--generation-config``).

vLLM (``--generation-config auto``, its default) and SGLang (``--sampling-defaults model``, its default) both take
the recommended values as the defaults of requests that do not set them; HF ``generate`` does the same. So a
Llama 3 Instruct model (``temperature`` 0.6, ``top_p`` 0.9) samples alike in all of them, and batchgen follows.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any, get_type_hints

from batchgen.errors import BatchgenError, FieldError, shown_value
from batchgen.loop.options import GENERATION_CONFIG_FILE
from batchgen.sampling.plain_values import whole_number
from batchgen.sampling.sampling_params import MODEL_SAMPLING_FIELDS, SamplingParams


def eos_token_ids(model_dir: Path | None, hf_config: Any) -> list[int]:
    """EOS ids as ``generate`` uses them: generation_config.json's ``eos_token_id`` (int or list), else config.json's.
    The model's own file: ``--generation-config DIR`` sets sampling defaults only.

    Raises:
        BatchgenError: a generation_config.json that cannot be read or is no JSON object.
    """
    eos = _read(model_dir).get("eos_token_id")
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _read(folder: Path | None) -> dict[str, Any]:
    """``folder/generation_config.json`` as a JSON object; empty for no folder or no file there. (Read as JSON, not
    by transformers' ``GenerationConfig``, whose checks warn about a temperature without ``do_sample``, which
    batchgen applies.)

    Raises:
        BatchgenError: the file cannot be read, or holds no JSON object.
    """
    path = folder / GENERATION_CONFIG_FILE if folder is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BatchgenError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict):
        raise BatchgenError(f"{path}: must hold a JSON object, got {shown_value(data)}")
    return data


def sampling_defaults(generation_config: str, model_dir: Path | None) -> tuple[dict[str, Any], str | None]:
    """The sampling defaults ``--generation-config`` ``generation_config`` reads, and the file it read them from
    (``None`` where it gave none): the model's generation_config.json (``auto``; none for a model without a folder,
    a ``random:`` one), none (``none``), or the given folder's (:func:`model_sampling_defaults`).

    Raises:
        BatchgenError: as :func:`model_sampling_defaults`.
    """
    folder = {"none": None, "auto": model_dir}.get(generation_config, Path(generation_config))
    values = model_sampling_defaults(folder)
    return values, f"{folder}/{GENERATION_CONFIG_FILE}" if values else None


def model_sampling_defaults(folder: Path | None) -> dict[str, Any]:
    """The sampling defaults ``folder/generation_config.json`` recommends, by batchgen's field names: those of
    :data:`~batchgen.sampling.sampling_params.MODEL_SAMPLING_FIELDS` it gives a value (not ``null``), as their
    declared types (an integer field takes a float with no fraction, as JSON writers give them); empty for no folder
    or no file there. ``do_sample`` is left aside, as vLLM and SGLang leave it: a temperature the file gives applies
    whatever ``do_sample`` says.

    Raises:
        BatchgenError: the file cannot be read or is no JSON object, or one of those values is of the wrong type or
            out of :meth:`SamplingParams.validate`'s range, or a ``max_new_tokens`` below 1 (one line naming the file
            and the field).
    """
    data = _read(folder)
    picked = {name: whole_number(data[name]) for name in MODEL_SAMPLING_FIELDS if data.get(name) is not None}
    types = get_type_hints(SamplingParams)
    try:
        for name, value in picked.items():
            integral = types[name] is int
            if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
                raise FieldError(name, f"must be {'an integer' if integral else 'a number'}, got {shown_value(value)}")
            picked[name] = types[name](value)
        if picked.get("max_new_tokens", 1) < 1:  # as HF's GenerationConfig checks: a model recommends some output
            raise FieldError("max_new_tokens", f"must be >= 1, got {picked['max_new_tokens']}")
        SamplingParams(**picked).validate(None)
    except FieldError as e:
        path = f"{folder}/{GENERATION_CONFIG_FILE}"
        note = "--generation-config none leaves its sampling defaults aside"
        raise BatchgenError(f"{path}: {e.field} {e.message} ({note})") from None
    return picked


def applied_note(left_to_model: Collection[str], values: dict[str, Any], file: str | None) -> str | None:
    """The line that says which of the sampling defaults ``values`` read from ``file`` a run takes (those of
    ``left_to_model``, which no option set), as vLLM logs that its defaults were overridden; ``None`` for none."""
    taken = [f"{name} {value}" for name, value in values.items() if name in left_to_model]
    if not taken:
        return None
    aside = "options and rows set their own; --generation-config none leaves them aside"
    return f"sampling defaults from {file}: {', '.join(taken)} ({aside})"
