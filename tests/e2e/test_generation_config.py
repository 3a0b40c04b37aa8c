"""``--generation-config``: a model's generation_config.json sets the run's sampling defaults that no flag, config
key or keyword sets, as vLLM's ``--generation-config auto`` and SGLang's ``--sampling-defaults model`` do; rows
still set their own. References: HF ``generate``'s greedy tokens (a file with ``temperature`` 0), the file's own
``max_new_tokens``, and batchgen's built-in defaults (vLLM's: temperature 1.0) where the file is left aside."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from batchgen.errors import BatchgenError
from batchgen.loop.generation_config import model_sampling_defaults
from tests.helpers.cli import generate, read_rows, run_args, run_cli, write_jsonl
from tests.helpers.hf_greedy import MAX_NEW, check_against_hf, greedy_prompts


def _with_generation_config(model_dir: Path, folder: Path, **values: Any) -> Path:
    """A copy of ``model_dir`` in ``folder`` whose generation_config.json also holds ``values``."""
    shutil.copytree(model_dir, folder)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(config | values))
    return folder


def _unsampled(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` without the sampling fields the model's file is to set."""
    return [{k: v for k, v in row.items() if k not in ("temperature", "max_new_tokens")} for row in rows]


def _recorded_defaults(out: Path) -> dict[str, Any]:
    metadata = pa.ipc.open_file(out).schema.metadata
    return json.loads(metadata[b"batchgen.sampling_defaults"])


@pytest.fixture
def greedy_model(random_models: dict[str, Path], tmp_path: Path) -> Path:
    """The tiny Llama, its generation_config.json recommending greedy decoding and MAX_NEW new tokens."""
    return _with_generation_config(random_models["llama"], tmp_path / "greedy", temperature=0.0, max_new_tokens=MAX_NEW)


def test_the_models_defaults_apply_to_rows_no_option_sets(greedy_model: Path, tmp_path: Path) -> None:
    rows = _unsampled(greedy_prompts(vocab=200))
    out = tmp_path / "out.arrow"
    results = generate(write_jsonl(tmp_path / "in.jsonl", rows), out, greedy_model)
    check_against_hf(greedy_model, rows, results)
    assert _recorded_defaults(out)["temperature"] == 0.0
    metadata = pa.ipc.open_file(out).schema.metadata
    assert json.loads(metadata[b"batchgen.model_sampling_defaults"]) == {"temperature": 0.0, "max_new_tokens": MAX_NEW}


def test_the_run_says_which_of_the_files_defaults_it_takes(greedy_model: Path, tmp_path: Path) -> None:
    """Found by a new user: nothing on stderr said the file's values were applied (vLLM logs that it did)."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Once upon a time"}])
    code, output = run_cli(run_args(dataset, tmp_path / "o.arrow", greedy_model, "--max-new-tokens", "2"))
    said = f"batchgen: sampling defaults from {greedy_model}/generation_config.json: temperature 0.0 (options and"
    assert code == 0 and said in output, output
    code, output = run_cli(run_args(dataset, tmp_path / "o.arrow", greedy_model, "--generation-config", "none"))
    assert code == 0 and "sampling defaults from" not in output, output


def test_flags_config_keys_and_rows_win_over_the_model(greedy_model: Path, tmp_path: Path) -> None:
    rows = [{"id": "a", "prompt": "Once upon a time"}, {"id": "b", "prompt": "Once upon a time", "max_new_tokens": 2}]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    flagged = generate(dataset, tmp_path / "flag.arrow", greedy_model, "--ignore-eos", "--max-new-tokens", "5")
    assert [len(flagged[i]["output_token_ids"]) for i in "ab"] == [5, 2]
    config = tmp_path / "run.yaml"
    config.write_text("max-new-tokens: 4\nignore-eos: true\ntemperature: null\n")  # null: not given
    from_config = generate(dataset, tmp_path / "config.arrow", greedy_model, "--config", str(config))
    assert [len(from_config[i]["output_token_ids"]) for i in "ab"] == [4, 2]
    assert _recorded_defaults(tmp_path / "config.arrow")["temperature"] == 0.0
    import batchgen

    model = str(greedy_model)
    batchgen.run(dataset, tmp_path / "api.arrow", model=model, ignore_eos=True, max_new_tokens=3, progress=False)
    assert _recorded_defaults(tmp_path / "api.arrow")["temperature"] == 0.0  # batchgen.run: as the command line
    from_api = read_rows(tmp_path / "api.arrow")
    assert [len(from_api[i]["output_token_ids"]) for i in "ab"] == [3, 2]
    # The flag gives the built-in default's own value: still the flag's, not the file's.
    generate(dataset, tmp_path / "t1.arrow", greedy_model, "--temperature", "1.0", "--max-new-tokens", "2")
    assert _recorded_defaults(tmp_path / "t1.arrow")["temperature"] == 1.0


def test_none_leaves_the_file_aside_and_a_folder_replaces_it(greedy_model: Path, tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Once upon a time"}])
    generate(dataset, tmp_path / "none.arrow", greedy_model, "--generation-config", "none", "--max-new-tokens", "2")
    assert _recorded_defaults(tmp_path / "none.arrow")["temperature"] == 1.0  # vLLM's and batchgen's own
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 1, "max_new_tokens": 3, "do_sample": False}))
    results = generate(dataset, tmp_path / "dir.arrow", greedy_model, "--generation-config", str(other), "--ignore-eos")
    recorded = _recorded_defaults(tmp_path / "dir.arrow")
    assert (recorded["top_k"], recorded["temperature"], recorded["max_new_tokens"]) == (1, 1.0, 3)
    assert len(results["a"]["output_token_ids"]) == 3


def test_a_resume_does_not_run_again_a_row_the_file_made_valid(greedy_model: Path, tmp_path: Path) -> None:
    """Found by a review: the rows a resumed output holds were counted by their samples under batchgen's own
    defaults, by which a row asking for more than 128 tokens at least is bad (0 samples): it ran again."""
    roomy = _with_generation_config(greedy_model, tmp_path / "roomy", max_new_tokens=300)
    rows = [{"id": "a", "prompt": "Once upon", "min_new_tokens": 150}]
    out = tmp_path / "out.arrow"
    generate(write_jsonl(tmp_path / "in.jsonl", rows), out, roomy, "--context-length", "256")
    dataset = write_jsonl(tmp_path / "in.jsonl", [*rows, {"id": "b", "prompt": "Once", "max_new_tokens": 2}])
    args = [a for a in run_args(dataset, out, roomy, "--context-length", "256") if a != "--overwrite"]
    code, output = run_cli([*args, "--resume"])
    assert code == 0 and "1 row was done before" in output and " + 2 output tokens" in output, output


def test_a_resume_compares_what_the_rows_default_to(greedy_model: Path, tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Once upon a time"}])
    out = tmp_path / "out.arrow"
    generate(dataset, out, greedy_model, "--max-new-tokens", "2")
    args = [a for a in run_args(dataset, out, greedy_model, "--max-new-tokens", "2") if a != "--overwrite"]
    code, output = run_cli([*args, "--resume", "--temperature", "0"])  # what the file gave: the same rows
    assert code == 0 and "already complete" in output, output
    code, output = run_cli([*args, "--resume", "--generation-config", "none"])
    assert code == 2 and "temperature 0.0 → 1.0" in output, output
    said = 'the model\'s generation_config.json defaults {"temperature": 0.0, "max_new_tokens": 10} → {}'
    assert f"{said} (--temperature 0.0 resumes as written)" in output, output


def test_an_output_written_before_the_file_was_read_says_why_it_differs() -> None:
    """Found by a review: an output of a batchgen that left the file aside was refused over "temperature 1.0 →
    0.6" alone, with nothing to say that the model's file changed it, nor how to resume as written."""
    from batchgen.job.run_metadata import MODEL_SAMPLING_KEY, job_differences

    key = "batchgen.sampling_defaults"
    recorded = {key: json.dumps({"temperature": 1.0, "top_k": -1})}
    now = {key: json.dumps({"temperature": 0.6, "top_k": -1}), MODEL_SAMPLING_KEY: '{"temperature": 0.6}'}
    differences = job_differences(recorded, now)
    assert "temperature 1.0 → 0.6" in differences
    assert (
        "the model's generation_config.json defaults none recorded (a batchgen that left them aside) → "
        '{"temperature": 0.6} (--temperature 1.0 resumes as written)'
    ) in differences
    # Rows pinned by a flag to what they were: no difference, and nothing said of the file.
    assert not [d for d in job_differences(recorded, {**now, key: recorded[key]}) if "generation_config" in d]


@pytest.mark.parametrize(
    ("values", "said"),
    [
        ({"top_p": 2}, "top_p must be in (0, 1], got 2.0"),
        ({"temperature": "hot"}, 'temperature must be a number, got "hot"'),
        ({"top_k": 2.5}, "top_k must be an integer, got 2.5"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer, got true"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
    ],
)
def test_a_bad_value_in_the_file_is_one_line_naming_it(
    random_models: dict[str, Path], tmp_path: Path, values: dict[str, Any], said: str
) -> None:
    model = _with_generation_config(random_models["llama"], tmp_path / "bad", **values)
    code, output = run_cli(run_args(write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}]), tmp_path / "o.arrow", model))
    assert code == 2, output
    assert f"{model / 'generation_config.json'}: {said}" in output and "Traceback" not in output, output


def test_a_model_file_that_is_no_object_is_one_line_with_the_file_aside_too(
    random_models: dict[str, Path], tmp_path: Path
) -> None:
    """Found by a review: transformers' reading of its EOS ids raised a traceback first (a list; a max_new_tokens
    of 0), even under --generation-config none."""
    model = _with_generation_config(random_models["llama"], tmp_path / "bad")
    (model / "generation_config.json").write_text("[1, 2]")
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}])
    for extra in ([], ["--generation-config", "none"]):
        code, output = run_cli(run_args(dataset, tmp_path / "o.arrow", model, *extra))
        said = f"{model / 'generation_config.json'}: must hold a JSON object, got [1, 2]"
        assert code == 2 and said in output and "Traceback" not in output, output


def test_file_values_read_by_their_types(tmp_path: Path) -> None:
    # A whole float is an integer (as JSON writers give them); null and fields vLLM does not read are left aside.
    assert model_sampling_defaults(None) == model_sampling_defaults(tmp_path) == {}  # no folder, no file
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"top_k": 20.0, "top_p": 1, "min_p": None, "do_sample": False, "num_beams": 4, "temperature": 0.7})
    )
    assert model_sampling_defaults(tmp_path) == {"top_k": 20, "top_p": 1.0, "temperature": 0.7}
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(BatchgenError, match="must hold a JSON object"):
        model_sampling_defaults(tmp_path)


def test_options_that_break_a_rule_with_the_files_values(greedy_model: Path, tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}])
    code, output = run_cli(run_args(dataset, tmp_path / "o.arrow", greedy_model, "--min-new-tokens", "20"))
    assert code == 2, output
    said = f"--min-new-tokens: must be <= max_new_tokens ({MAX_NEW}), got 20, with the defaults of {greedy_model}/"
    assert said in output, output
    # Found by a review: checked against the built-in 128 before the file's larger max_new_tokens was read.
    roomy = _with_generation_config(greedy_model, tmp_path / "roomy", max_new_tokens=300)
    rows = generate(dataset, tmp_path / "min.arrow", roomy, "--min-new-tokens", "200", "--context-length", "256")
    assert all(len(row["output_token_ids"]) >= 200 for row in rows.values())
    assert _recorded_defaults(tmp_path / "min.arrow")["max_new_tokens"] == 300
    from batchgen.loop.options import EngineOptions

    EngineOptions(generation_config="/on/the/replicas").validate(here=False)  # --ray: a folder read there
    with pytest.raises(BatchgenError, match="SGLang's 'model' is batchgen's 'auto'"):
        EngineOptions(generation_config="model").validate(here=False)  # another engine's word, wherever read
    for value, hint in [
        ("vllm", "(vLLM's 'vllm', its own defaults, is batchgen's 'none')"),
        ("model", "(SGLang's 'model' is batchgen's 'auto')"),
        ("AUTO", "(did you mean 'auto'?)"),
        ("", "'' is no directory"),  # not the working directory's file
    ]:
        code, output = run_cli(run_args(dataset, tmp_path / "o.arrow", greedy_model, "--generation-config", value))
        assert code == 2 and hint in output, output


def test_the_python_api_takes_them_as_the_command_line(greedy_model: Path) -> None:
    from batchgen import Generator

    generator = Generator(str(greedy_model), dtype="float32", device="cpu")
    rows = [{k: v for k, v in row.items() if k != "top_logprobs"} for row in _unsampled(greedy_prompts(vocab=200))]
    results = {r["id"]: r for r in generator.generate(rows)}
    check_against_hf(greedy_model, rows, results)
    longer = generator.generate([{"prompt": "Once upon"}], max_new_tokens=12, ignore_eos=True)
    assert len(longer[0]["output_token_ids"]) == 12
    as_given = Generator(str(greedy_model), dtype="float32", device="cpu", generation_config="none")
    assert as_given.engine.facts().sampling_defaults == {}


def test_the_benchmarks_leave_the_file_aside(random_models: dict[str, Path], tmp_path: Path) -> None:
    """Found by a review: bench and bench-one-batch, whose rows are greedy whatever the file says and which take no
    --generation-config, refused a model whose file held a bad sampling value."""
    model = _with_generation_config(random_models["llama"], tmp_path / "m", temperature="0.7")
    common = ["--model", str(model), "--dtype", "float32", "--device", "cpu"]
    code, output = run_cli(["bench", *common, "--num-prompts", "2", "--input-len-range", "4:8", "--output-len", "2"])
    assert code == 0, output
    code, output = run_cli(["bench-one-batch", *common, "--batch-size", "1", "--input-len", "8", "--output-len", "2"])
    assert code == 0, output


def test_status_reads_the_file_of_the_model_it_is_given(greedy_model: Path, tmp_path: Path) -> None:
    """Found by a review: ``status --model OTHER`` read the file in the recorded model's folder, and so named fewer
    differences than ``--resume`` then refused over."""
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Once upon a time"}])
    out = tmp_path / "out.arrow"
    generate(dataset, out, greedy_model)
    other = _with_generation_config(greedy_model, tmp_path / "other", top_p=0.5)
    code, output = run_cli(["status", str(dataset), str(out), "--model", str(other), "--dtype", "float32"])
    assert code == 1 and "top_p 1.0 → 0.5" in output, output
