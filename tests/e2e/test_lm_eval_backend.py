"""lm-evaluation-harness itself as the client: local tasks of each request type (tests/data/lm_eval_tasks: multiple
choice after a shared 3-shot context, rolling log-likelihood, greedy generation until stop strings) run through
``--model hf`` and ``--model batchgen`` in float32 give the same metrics, per-request log-likelihoods within 1e-4
(lm-eval's logged samples) and the same generations."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]'; '.[dev]' has it too)")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from batchgen.errors import BatchgenError  # noqa: E402
from batchgen.eval import BatchgenLM  # noqa: E402  (the import registers --model batchgen)
from tests.helpers.models import REPO, STORIES, build_random_model, needs_shared  # noqa: E402

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


@pytest.fixture(scope="module")
def tasks(task_dir: Path) -> TaskManager:
    """The test's tasks alone: indexing lm-eval's thousands of built-in ones takes ~10 s per TaskManager."""
    return TaskManager(include_path=str(task_dir), include_defaults=False)


@pytest.fixture(scope="module")
def llama_results(tasks: TaskManager, llama_dir: Path) -> dict[str, dict[str, Any]]:
    """The three tasks on the random Llama at its whole context (max_length's default, 256), through each backend."""
    args = f"pretrained={llama_dir},dtype=float32"
    return {model: evaluate(tasks, model, args) for model in ("hf", "batchgen")}


def evaluate(
    manager: TaskManager, model: str | BatchgenLM, model_args: str | dict[str, Any], **options: Any
) -> dict[str, Any]:
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=options.pop("tasks", TASKS),
        task_manager=manager,
        log_samples=True,
        bootstrap_iters=0,
        device="cpu",
        batch_size=16,  # HF's; batchgen ignores it
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
                    # A whole document's sum: float32 rounding of two engines' kernels adds up with its length
                    # (1.5e-4 on a 1,641-nat document on an AVX2-only Zen 1), hence a bound that grows with it.
                    assert abs(got - expected) < 1e-4 + 1e-6 * abs(expected), where
                else:  # loglikelihood: (logprob, is_greedy)
                    assert abs(got[0] - expected[0]) < 1e-4, where
                    assert got[1] == expected[1], where


def samples_seen(results: dict[str, Any]) -> int:
    return sum(len(samples) for samples in results["samples"].values())


@needs_shared
def test_stories260k_same_as_hf(tasks: TaskManager) -> None:
    """At the model's whole context (512 positions) every request fits: the 3-shot context every question starts
    with, and each question's context before its 4 choices, come from the prefix cache after their first request."""
    args = f"pretrained={STORIES},dtype=float32"
    hf = evaluate(tasks, "hf", args)
    lm = BatchgenLM(pretrained=str(STORIES), dtype="float32")
    ours = evaluate(tasks, lm, "")
    assert samples_seen(ours) == 40 + 8 + 10
    assert_same_results(hf, ours)
    assert ours["results"]["batchgen_generate"]["exact_match,none"] > 0  # the comparison is not of empty texts
    stats = lm.generator.engine.stats
    assert stats.cached_tokens > 0.8 * stats.admitted_prompt_tokens, (stats.cached_tokens, stats.admitted_prompt_tokens)


def test_random_llama_same_as_hf(llama_results: dict[str, dict[str, Any]]) -> None:
    """The 3-shot contexts (~300 tokens) are cut to the model's 256 positions; the longer stories fill whole
    rolling windows of 257 tokens, the last one only a target."""
    assert samples_seen(llama_results["batchgen"]) == 40 + 8 + 10
    assert_same_results(llama_results["hf"], llama_results["batchgen"])


def test_chat_template_same_as_hf(tasks: TaskManager, llama_dir: Path) -> None:
    """``--apply_chat_template``: the shots as turns of a conversation, rendered by the tokenizer's template; at
    max_length 48 the contexts are cut, those of generations (~35 tokens) to their last 48 - 24."""
    args = f"pretrained={llama_dir},dtype=float32,max_length=48"
    options = dict(tasks=["batchgen_choice", "batchgen_generate"], apply_chat_template=True, limit=10)
    hf = evaluate(tasks, "hf", args, **options)
    ours = evaluate(tasks, "batchgen", args, **options)
    ((context, _),) = ours["samples"]["batchgen_generate"][0]["arguments"]
    assert context.startswith("<|user|>") and context.endswith("<|assistant|>"), context
    assert_same_results(hf, ours)


def test_command_line(
    task_dir: Path, llama_dir: Path, llama_results: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
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
    hf = llama_results["hf"]
    assert generated == {s["doc_id"]: s["filtered_resps"][0] for s in hf["samples"]["batchgen_generate"]}


def request(kind: str, doc_id: int, *arguments: Any) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=arguments, idx=0, metadata=("overlong", doc_id, 1))


@pytest.fixture(scope="module")
def short_lm(llama_dir: Path) -> BatchgenLM:
    """The random Llama read 16 tokens at a time (its engine's context stays 256)."""
    return BatchgenLM(pretrained=str(llama_dir), dtype="float32", max_length=16)


def test_requests_truncation_cannot_fix_do_not_stop_the_evaluation(
    short_lm: BatchgenLM, llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Where HF asserts (a continuation longer than max_length, max_gen_toks >= max_length), each request still
    gets a result, and a warning names it; the scored part is the last max_length + 1 tokens, as HF reads them."""
    import torch
    from transformers import AutoModelForCausalLM

    lm = short_lm
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


BAD_MODEL_ARGS = [
    ("pretrained=/no/such/model", "/no/such/model: no such model directory"),
    ("dtype=float32", "--model_args needs pretrained=MODEL"),
    ("pretrained={model},max_length=abc", "--model_args max_length: must be an integer >= 1, got 'abc'"),
    ("pretrained={model},max_length=-5", "--model_args max_length: must be an integer >= 1, got -5"),
    ("pretrained={model},max_running_request=4", "did you mean 'max_running_requests'?"),
    ("pretrained={model} --apply_chat_template", "--apply_chat_template: the model's tokenizer has no chat template"),
    # Found by a user: a traceback, and a run that scored every request -inf and exited 0.
    ("pretrained={model},add_bos_token=maybe", "--model_args add_bos_token: must be true or false, got 'maybe'"),
    ("pretrained={model},prefix_token_id=99999", "--model_args prefix_token_id: 99999 is outside the vocabulary"),
    # Found by an lm-eval user: named by batchgen's flags (lm-eval has a --seed of its own, which is not this one).
    ("pretrained={model},seed=abc", '--model_args seed: must be an integer, got "abc"'),
    ("pretrained={model},dtype=float64", "--model_args unknown dtype 'float64'; choose auto, float32"),
    ("pretrained={model},mem_fraction=2", "--model_args mem_fraction must be in (0, 1), got 2"),
    # Other backends' keys asking for what batchgen does not do.
    ("pretrained={model},tokenizer=gpt2", "--model_args tokenizer: batchgen uses the model's own tokenizer, got"),
    ("pretrained={model},tensor_parallel_size=2", "--model_args tensor_parallel_size: batchgen runs one engine on"),
    ("pretrained={model},revision=v2.0", "--model_args revision: batchgen loads the model's files as they are"),
    # Sampling options: lm-eval's are a task's gen_kwargs (they pointed at batchgen's generate() and stream()).
    ("pretrained={model},temperature=0.5", "--model_args temperature: a sampling option; lm-eval takes it from"),
    ("pretrained={model},max_tokens=8", "--model_args max_tokens: a sampling option; lm-eval's is the max_gen_toks"),
    ("pretrained={model},json_schema=x", "--model_args json_schema: a sampling option; lm-eval's requests carry no"),
    ("pretrained={model},stop=x", "--model_args stop: a sampling option; lm-eval's is a task's until"),
    ("pretrained={model},n=2", "--model_args n: a sampling option; lm-eval's requests set it themselves"),
    ("pretrained={model},min_tokens=2", "or --gen_kwargs min_new_tokens=VALUE for every generate_until task"),
]


@pytest.mark.parametrize(("model_args", "message"), BAD_MODEL_ARGS)
def test_bad_model_args_raise_batchgens_error(
    tasks: TaskManager, random_models: dict[str, Path], model_args: str, message: str
) -> None:
    """Through lm-eval's Python API, given ``model_args`` as its command line parses them (-5 becomes -5.0)."""
    from lm_eval._cli.utils import key_val_to_dict

    model_args, *flags = model_args.format(model=random_models["llama"]).split()
    options = {"apply_chat_template": True} if flags == ["--apply_chat_template"] else {}
    with pytest.raises(BatchgenError) as error:
        evaluate(tasks, "batchgen", key_val_to_dict(model_args), tasks=["batchgen_generate"], **options)
    # Not followed by more of a number or a word: "got -5" must not be "got -5.0".
    assert re.search(re.escape(message) + r"(?![\w.])", str(error.value)), str(error.value)


def test_the_models_sampling_defaults_are_left_aside_unless_asked_for(
    tasks: TaskManager, random_models: dict[str, Path], tmp_path: Path
) -> None:
    """As under ``--model vllm``, whose backend gives vLLM whole SamplingParams: the model's generation_config.json
    sets no default (here its bad temperature is never read), unless the ``generation_config`` model arg asks."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(random_models["llama"], model)
    config = model / "generation_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "temperature": "hot"}))
    evaluate(tasks, "batchgen", f"pretrained={model},dtype=float32", tasks=["batchgen_generate"])
    with pytest.raises(BatchgenError, match='temperature must be a number, got "hot"'):
        evaluate(tasks, "batchgen", f"pretrained={model},generation_config=auto", tasks=["batchgen_generate"])


def test_other_backends_model_args_that_ask_for_nothing_else_are_taken(llama_dir: Path) -> None:
    """Found by an lm-eval user: ``--model_args`` lines written for ``--model hf`` or ``--model vllm``
    (``trust_remote_code=True``, ``tensor_parallel_size=1``, ``revision=main``, the model as its own ``tokenizer``,
    vLLM's ``dtype=half``) were refused; they ask for nothing batchgen does otherwise."""
    given = "trust_remote_code=True,tensor_parallel_size=1,data_parallel_size=1,revision=main,use_fast_tokenizer=True"
    lm = BatchgenLM.create_from_arg_string(f"pretrained={llama_dir},tokenizer={llama_dir}/,dtype=half,{given}")
    assert lm.generator.options.dtype == "float16"
    assert lm.generator.options.seed == 1234  # lm-eval's vLLM backend's default: sampled tasks repeat


def test_enable_thinking_reaches_the_chat_template(llama_dir: Path) -> None:
    """lm-eval's HF and vLLM backends take ``enable_thinking`` and ``chat_template_args`` for the chat template
    (found by a review: batchgen refused them); the rendering equals transformers' with those arguments."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if not enable_thinking %} quick{% endif %}"
    lm = BatchgenLM.create_from_arg_obj(
        {"pretrained": str(llama_dir), "enable_thinking": False, "chat_template_args": {"enable_thinking": True}}
    )
    lm.tokenizer.chat_template = template
    history = [{"role": "user", "content": "Hi"}]
    expected = lm.tokenizer.apply_chat_template(
        history, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert lm.apply_chat_template(history) == expected and expected.endswith(" quick")


def test_a_model_args_error_names_keys_not_text_in_paths() -> None:
    """batchgen's flags in an option's error become ``--model_args`` keys; a ``--name`` inside a path is the path's
    (found by a review: ``/x--device--model`` was shown as ``/xdevicemodel``)."""
    from batchgen.eval.model_args import as_model_args_error

    path_error = BatchgenError("/x--device--model: no such model directory")
    assert as_model_args_error(path_error) is path_error
    seed_error = as_model_args_error(BatchgenError('--seed: must be an integer, got "abc"'))
    assert str(seed_error) == '--model_args seed: must be an integer, got "abc"'


def test_a_whitespace_context_is_the_empty_context(llama_dir: Path) -> None:
    """Found by an lm-eval user: lm-eval moves a context's trailing whitespace to the continuation, so a context of
    whitespace alone encodes to no tokens (``--model hf`` asserts there); batchgen scored the continuation without
    its first token (or -inf), warning of a continuation longer than max_length. It is the empty context: the
    continuation after the prefix token, as HF scores a context of \"\"."""
    import torch
    from transformers import AutoModelForCausalLM

    lm = BatchgenLM(pretrained=str(llama_dir), dtype="float32", add_bos_token=False)
    context_ids, continuation_ids = lm._encode_pair("  ", "  spaced")
    assert context_ids == [] and len(continuation_ids) >= 2
    ((score, _),) = lm.loglikelihood([request("loglikelihood", 0, "  ", "  spaced")])
    ids = [lm.prefix_token_id, *continuation_ids]
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids[:-1]])).logits[0], dim=-1)
    assert abs(score - sum(logprobs[i, ids[i + 1]].item() for i in range(len(ids) - 1))) < 1e-4


def test_an_option_in_model_args_and_in_lm_evals_flags_takes_the_model_args_value(llama_dir: Path) -> None:
    """Found by a user: ``--model_args ...,device=cpu`` failed as lm-eval's own ``--device`` (``cuda:0`` when not
    given) repeated the keyword; ``--model hf`` fails so too. lm-eval builds the model with both (its
    ``LM.create_from_arg_string``)."""
    lm = BatchgenLM.create_from_arg_string(f"pretrained={llama_dir},device=cpu,batch_size=8", {"device": "cuda:0"})
    assert lm.generator.options.device == "cpu"
    lm = BatchgenLM.create_from_arg_obj({"pretrained": str(llama_dir)}, {"device": "cpu", "batch_size": None})
    assert lm.generator.options.device == "cpu"


# One error raised while the model is built, one while the requests are made: the command line's handler sees both.
@pytest.mark.parametrize(("model_args", "message"), [BAD_MODEL_ARGS[0], BAD_MODEL_ARGS[-1]])
def test_bad_model_args_are_one_line(
    task_dir: Path,
    random_models: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    model_args: str,
    message: str,
) -> None:
    """On the command line (each run indexes lm-eval's built-in tasks, see ``tasks``: two cases, not all)."""
    from batchgen.eval.__main__ import main

    model_args = model_args.format(model=random_models["llama"])
    argv = ["batchgen.eval", "--model", "batchgen", "--model_args", *model_args.split(), "--tasks"]
    monkeypatch.setattr(sys, "argv", [*argv, "batchgen_generate", "--include_path", str(task_dir)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    # Exit code 2 comes from batchgen.eval's handler alone: the error was caught there, not shown as a traceback.
    assert lines[-1].startswith("batchgen: error: ") and message in lines[-1], lines


def test_a_scoring_row_holds_one_token_more_than_the_context(short_lm: BatchgenLM) -> None:
    """lm-eval's windows are max_length + 1 tokens, the last only a target: at max_length = the context length
    (256) they fit because a row that only scores never runs its last token; one more token does not fit, and a
    row that generates gets the usual limit."""
    tokens = [0, *([5, 9, 13] * 90)]
    rows = [
        {"prompt_token_ids": tokens[:257], "prompt_logprobs_from": 200, "max_new_tokens": 0},
        {"prompt_token_ids": tokens[:258], "prompt_logprobs_from": 200, "max_new_tokens": 0},
        {"prompt_token_ids": tokens[:256], "max_new_tokens": 1},
    ]
    fits, too_long, generates = short_lm.generator.generate(rows, on_error="skip")
    assert fits["error"] is None and len(fits["prompt_logprobs"]) == 57
    assert too_long["error"] == (
        "rows:2: field 'prompt_token_ids': prompt has 258 tokens, > context length 256 + 1 (a row that only scores "
        "its prompt)"
    )
    assert generates["error"] == (
        "rows:3: field 'prompt_token_ids': prompt has 256 tokens, >= context length 256 (truncate_prompt_tokens -1 "
        "keeps the last that fit)"
    )


def test_max_length_beyond_the_context_is_refused(llama_dir: Path) -> None:
    with pytest.raises(BatchgenError, match="^--model_args max_length: 300 exceeds the context length 256$"):
        BatchgenLM.create_from_arg_string(f"pretrained={llama_dir},dtype=float32,max_length=300")


@pytest.mark.parametrize("add_bos_token", [None, False, True])
def test_tokens_as_hf_makes_them(llama_dir: Path, add_bos_token: bool | None) -> None:
    """The same ids as HF's backend for each ``add_bos_token``: strings, a string that starts with the BOS text,
    context/continuation pairs (a context's trailing space moves to the continuation), an empty context's
    continuation (``TemplateLM.loglikelihood`` encodes it without special tokens, after the prefix token)."""
    from lm_eval.models.huggingface import HFLM

    args = {"pretrained": str(llama_dir), "dtype": "float32", "add_bos_token": add_bos_token}
    hf, ours = HFLM(device="cpu", **args), BatchgenLM(**args)
    for text in ("Once upon a time", "<s>Once upon a time", " leading space"):
        assert ours.tok_encode(text) == hf.tok_encode(text), text
        assert ours.tok_encode(text, add_special_tokens=False) == hf.tok_encode(text, add_special_tokens=False)
    assert ours.prefix_token_id == hf.prefix_token_id and ours.eot_token_id == hf.eot_token_id
    for context, continuation in (("Question: 2 + 2?\nAnswer: ", "4"), ("The cat", " sat")):
        assert ours._encode_pair(context, continuation) == hf._encode_pair(context, continuation)


def test_sampling_arguments_reach_the_sampler(short_lm: BatchgenLM) -> None:
    """``do_sample`` with ``top_k`` 1 samples the argmax: the greedy text; with a high temperature, other texts."""
    base = {"until": ["\n"], "max_gen_toks": 8}
    sampled = [{**base, "do_sample": True, "temperature": 5.0, "seed": seed} for seed in range(4)]
    kwargs = [{**base, "do_sample": False}, {**base, "do_sample": True, "temperature": 1.0, "top_k": 1}, *sampled]
    texts = short_lm.generate_until([request("generate_until", i, "Once upon a time", k) for i, k in enumerate(kwargs)])
    assert texts[1] == texts[0]
    assert any(text != texts[0] for text in texts[2:])
