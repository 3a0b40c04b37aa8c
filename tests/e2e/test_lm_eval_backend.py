"""lm-evaluation-harness itself as the client: local tasks of each request type (tests/data/lm_eval_tasks: multiple
choice after a shared 3-shot context, rolling log-likelihood, greedy generation until stop strings) run through
``--model hf`` and ``--model batchgen`` in float32 give the same metrics, per-request log-likelihoods within 1e-4
(lm-eval's logged samples) and the same generations."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lm_eval
import pytest
import yaml
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from batchgen.eval import BatchgenLM  # the import registers --model batchgen
from tests.helpers.models import REPO, STORIES, build_random_model, needs_shared

TASK_DATA = REPO / "tests" / "data" / "lm_eval_tasks"
TASKS = ["batchgen_choice", "batchgen_rolling", "batchgen_generate"]
# A chat template of the test's own: the random model's tokenizer has none.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The task YAMLs with their data files as absolute paths: ``datasets`` reads a relative one from the current
    directory, not from the YAML's."""
    out = tmp_path_factory.mktemp("lm_eval_tasks")
    for path in TASK_DATA.glob("*.yaml"):
        config = yaml.safe_load(path.read_text())
        files = config["dataset_kwargs"]["data_files"]
        config["dataset_kwargs"]["data_files"] = {split: str(TASK_DATA / name) for split, name in files.items()}
        (out / path.name).write_text(yaml.safe_dump(config))
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama (tests/helpers/models.py) whose tokenizer has a chat template."""
    from transformers import AutoTokenizer

    model_dir = build_random_model(tmp_path_factory.mktemp("models") / "llama", "llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    return model_dir


def evaluate(task_dir: Path, model: str, model_args: str, **options: Any) -> dict[str, Any]:
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=options.pop("tasks", TASKS),
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
        bootstrap_iters=0,
        device="cpu",
        **options,
    )
    assert results is not None
    return results


def assert_same_results(hf: dict[str, Any], ours: dict[str, Any]) -> None:
    """The same metrics; per request, log-likelihoods within 1e-4, the same is-greedy flags and generations."""
    assert hf["results"].keys() == ours["results"].keys()
    for task, metrics in hf["results"].items():
        for name, value in metrics.items():
            if isinstance(value, float):
                assert ours["results"][task][name] == pytest.approx(value, rel=1e-5, abs=1e-9), (task, name)
        hf_samples = sorted(hf["samples"][task], key=lambda s: s["doc_id"])
        our_samples = sorted(ours["samples"][task], key=lambda s: s["doc_id"])
        assert [s["arguments"] for s in hf_samples] == [s["arguments"] for s in our_samples]
        for hf_sample, our_sample in zip(hf_samples, our_samples):
            where = (task, hf_sample["doc_id"])
            assert len(our_sample["resps"]) == len(hf_sample["resps"]), where
            for (expected,), (got,) in zip(hf_sample["resps"], our_sample["resps"]):
                if isinstance(expected, str):  # generate_until
                    assert got == expected, where
                elif isinstance(expected, float):  # loglikelihood_rolling
                    assert abs(got - expected) < 1e-4, where
                else:  # loglikelihood: (logprob, is_greedy)
                    assert abs(got[0] - expected[0]) < 1e-4, where
                    assert got[1] == expected[1], where


def samples_seen(results: dict[str, Any]) -> int:
    return sum(len(samples) for samples in results["samples"].values())


@needs_shared
def test_stories260k_same_as_hf(task_dir: Path) -> None:
    """max_length 48: every 3-shot context is cut (HF's left truncation), each story spans several rolling
    windows, and each generation reads the last 24 tokens of its prompt."""
    args = f"pretrained={STORIES},dtype=float32,max_length=48"
    hf = evaluate(task_dir, "hf", args)
    ours = evaluate(task_dir, "batchgen", args)
    assert samples_seen(ours) == 40 + 8 + 10
    assert_same_results(hf, ours)
    assert ours["results"]["batchgen_generate"]["exact_match,none"] > 0  # the comparison is not of empty texts


def test_random_llama_same_as_hf(task_dir: Path, llama_dir: Path) -> None:
    """The model's whole context (256 positions, max_length's default): the 3-shot contexts fit, the longer
    stories fill whole rolling windows of 257 tokens."""
    args = f"pretrained={llama_dir},dtype=float32"
    hf = evaluate(task_dir, "hf", args)
    ours = evaluate(task_dir, "batchgen", args)
    assert samples_seen(ours) == 40 + 8 + 10
    assert_same_results(hf, ours)


def test_chat_template_same_as_hf(task_dir: Path, llama_dir: Path) -> None:
    """``--apply_chat_template``: the shots as turns of a conversation, rendered by the tokenizer's template."""
    args = f"pretrained={llama_dir},dtype=float32"
    options = dict(tasks=["batchgen_choice", "batchgen_generate"], apply_chat_template=True, limit=10)
    hf = evaluate(task_dir, "hf", args, **options)
    ours = evaluate(task_dir, "batchgen", args, **options)
    context = ours["samples"]["batchgen_generate"][0]["arguments"]["gen_args_0"]["arg_0"]
    assert context.startswith("<|user|>") and context.endswith("<|assistant|>"), context
    assert_same_results(hf, ours)


def test_command_line(task_dir: Path, llama_dir: Path, tmp_path: Path) -> None:
    """``python -m batchgen.eval`` is lm-eval's command line with batchgen registered: ``--output_path`` and
    ``--log_samples`` write lm-eval's files, with HF's generations."""
    args = f"pretrained={llama_dir},dtype=float32"
    command = [sys.executable, "-m", "batchgen.eval", "--model", "batchgen", "--model_args", args]
    command += ["--tasks", "batchgen_generate", "--include_path", str(task_dir), "--output_path", str(tmp_path)]
    command += ["--log_samples"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "|batchgen_generate|" in result.stdout
    (samples_file,) = tmp_path.rglob("samples_batchgen_generate_*.jsonl")
    (results_file,) = tmp_path.rglob("results_*.json")
    assert json.loads(results_file.read_text())["config"]["model"] == "batchgen"
    # Lines split at "\n" only: the random model's texts hold characters str.splitlines() also breaks at.
    rows = [json.loads(line) for line in samples_file.read_text().split("\n") if line]
    generated = {row["doc_id"]: row["filtered_resps"][0] for row in rows}
    hf = evaluate(task_dir, "hf", args, tasks=["batchgen_generate"])
    assert generated == {s["doc_id"]: s["filtered_resps"][0] for s in hf["samples"]["batchgen_generate"]}


def request(kind: str, doc_id: int, *arguments: Any) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=arguments, idx=0, metadata=("overlong", doc_id, 1))


def test_requests_truncation_cannot_fix_do_not_stop_the_evaluation(
    llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Where HF asserts (a continuation longer than max_length, max_gen_toks >= max_length), each request still
    gets a result, and a warning names it; the scored part is the last max_length + 1 tokens, as HF reads them."""
    import torch
    from transformers import AutoModelForCausalLM

    lm = BatchgenLM(pretrained=str(llama_dir), dtype="float32", max_length=16)
    context, continuation = "The cat", " sat on the mat while the dog slept by the fire"
    with caplog.at_level(logging.WARNING):
        (score, short) = lm.loglikelihood(
            [request("loglikelihood", 3, context, continuation), request("loglikelihood", 4, "The cat", " sat")]
        )
        (text,) = lm.generate_until([request("generate_until", 5, "Once upon a time", {"max_gen_toks": 40})])
    assert "only its last 16 tokens are scored" in caplog.text
    assert "generate_until request of task overlong, doc 5: max_gen_toks 40 >= max_length 16" in caplog.text
    assert isinstance(text, str) and text
    whole = lm.tok_encode(context + continuation)[-17:]
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([whole[:-1]])).logits[0], dim=-1)
    assert abs(score[0] - sum(logprobs[i, whole[i + 1]].item() for i in range(16))) < 1e-4
    assert short[0] < 0


def test_bad_model_args_are_one_line(
    task_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from batchgen.eval.__main__ import main

    argv = ["batchgen.eval", "--model", "batchgen", "--model_args", "pretrained=/no/such/model", "--tasks"]
    monkeypatch.setattr(sys, "argv", [*argv, "batchgen_generate", "--include_path", str(task_dir)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith("batchgen: error: unknown model '/no/such/model'"), lines
