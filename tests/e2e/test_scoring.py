"""Scoring part of a prompt (``prompt_logprobs_from``, ``continuation``): HF's teacher-forced log_softmax, lm-eval's
context/continuation split, logits only where asked, the context from the prefix cache."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchgen.job.continuation import split_continuation
from tests.helpers.cli import read_rows, run_args, run_cli, write_jsonl
from tests.helpers.engine import UNMATCHED_STOP

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def hf_scores(model_dir: Path, ids: list[int], start: int) -> tuple[list[float], bool]:
    """HF float32: the logprob of each token ``ids[start:]`` given those before it, and whether each is the
    argmax there (lm-eval's ``is_greedy``)."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    targets = torch.tensor(ids[start:])
    rows = logprobs[start - 1 : len(ids) - 1]
    return rows.gather(1, targets[:, None]).squeeze(1).tolist(), bool((rows.argmax(-1) == targets).all())


def greedy_chain(model_dir: Path, ids: list[int], count: int) -> list[int]:
    """``count`` tokens HF's greedy decoding appends to ``ids``."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = list(ids)
    with torch.no_grad():
        for _ in range(count):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


@pytest.mark.parametrize(
    "options",
    [{}, {"chunked_prefill_size": 16, "max_total_tokens": 100}, {"prefix_cache": False, "chunked_prefill_size": 32}],
    ids=["default", "chunked-tight-pool", "no-prefix-cache"],
)
def test_continuations_equal_hf_with_lm_head_only_where_asked(
    random_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, options: dict[str, Any]
) -> None:
    import batchgen
    from batchgen.models.logits_processor import LogitsProcessor

    model_dir = random_models["llama"]
    rng = random.Random(3)
    context = [0] + [rng.randrange(2, 300) for _ in range(70)]
    continuations = [[rng.randrange(2, 300) for _ in range(n)] for n in (1, 2, 4, 5)]
    continuations.append(greedy_chain(model_dir, context, 3))  # every token the argmax: is_greedy true
    rows = [
        {"id": str(i), "prompt_token_ids": context + c, "prompt_logprobs_from": len(context), "max_new_tokens": 0}
        for i, c in enumerate(continuations)
    ]
    projected: list[int] = []
    original = LogitsProcessor._logits

    def spy(hidden: torch.Tensor, lm_head: Any, rows: torch.Tensor, fb: Any) -> torch.Tensor:
        logits = original(hidden, lm_head, rows, fb)
        projected.append(logits.shape[0])
        return logits

    monkeypatch.setattr(LogitsProcessor, "_logits", staticmethod(spy))
    # In the tight pool, rows that generate make the scheduler retract requests, scoring ones among them (their
    # stop string makes it estimate their growth, and over-admit).
    generating = [
        {
            "id": f"g{i}",
            "prompt_token_ids": [0, *rng.sample(range(2, 300), 20)],
            "max_new_tokens": 40,
            "ignore_eos": True,
            "stop": [UNMATCHED_STOP],
        }
        for i in range(3 if "max_total_tokens" in options else 0)
    ]
    generator = batchgen.Generator(str(model_dir), dtype="float32", seed=0, **options)
    results = generator.generate(generating[:2] + rows[:2] + generating[2:] + rows[2:])
    results = [r for r in results if not r["id"].startswith("g")]
    assert generator.engine.scheduler.num_retracted >= bool(generating)
    for row, result in zip(rows, results):
        expected, greedy = hf_scores(model_dir, row["prompt_token_ids"], len(context))
        got = result["prompt_logprobs"]
        assert len(got) == len(expected)
        assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-4, row["id"]
        assert result["prompt_logprob_sum"] == pytest.approx(sum(expected), abs=1e-4)
        assert result["prompt_is_greedy"] is greedy
        assert result["output_token_ids"] == [] and result["finish_reason"] == "length"
    assert results[-1]["prompt_is_greedy"] is True and not all(r["prompt_is_greedy"] for r in results)
    # The LM head ran on the scored positions alone (no row of a sampled next token), each once however the
    # prefill was chunked or retracted, and the context's K/V came from the prefix cache for every row after the
    # first (a pool this tight may evict it).
    assert sum(projected) == sum(len(c) for c in continuations) + 40 * len(generating)
    if not options:
        assert generator.engine.stats.cached_tokens >= (len(context) - 1) * (len(rows) - 1)


def test_one_token_prompt_and_samples(random_models: dict[str, Path]) -> None:
    import batchgen

    generator = batchgen.Generator(str(random_models["llama"]), dtype="float32", seed=0)
    one, *samples = generator.generate(
        [
            {"prompt_token_ids": [5], "prompt_logprobs": True, "max_new_tokens": 0},
            {"prompt_token_ids": [0, 7, 9], "prompt_logprobs_from": 2, "max_new_tokens": 0, "n": 2},
        ]
    )
    assert one["prompt_logprobs"] == [] and one["prompt_logprob_sum"] == 0.0 and one["prompt_is_greedy"] is True
    expected, greedy = hf_scores(random_models["llama"], [0, 7, 9], 2)
    assert [s["sample_index"] for s in samples] == [0, 1]
    for sample in samples:
        assert sample["prompt_logprobs"] == pytest.approx(expected, abs=1e-4) and sample["prompt_is_greedy"] is greedy


@pytest.mark.parametrize(
    ("context", "continuation"),
    [
        ("Once upon a time there was a little girl named ", "Lily"),  # the space moves to the continuation
        ("The quick brown fox jum", "ps over"),  # a word split across the boundary
        ("Numbers like 123", "45 and symbols"),
        ("", "Café, naïve"),  # no context: BOS, else EOS
        ("", "<s>Once"),  # no context, and the continuation starts with that token
        ("  ", "the cat"),
    ],
)
def test_split_equals_lm_evals(random_models: dict[str, Path], context: str, continuation: str) -> None:
    model = pytest.importorskip("lm_eval.api.model", reason="lm-eval (the [eval] extra) is not installed")
    instance = pytest.importorskip("lm_eval.api.instance")
    tokenizer = AutoTokenizer.from_pretrained(random_models["llama"])

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    class Reference(model.TemplateLM):  # lm-eval's own split, on the same tokenizer
        backend = "causal"
        prefix_token_id = eot_token_id = tokenizer.bos_token_id

        def tok_encode(self, string: str, **kwargs: Any) -> list[int]:
            return encode(string)

        def _loglikelihood_tokens(self, requests: Any, **kwargs: Any) -> Any:
            return [(context_enc, continuation_enc) for _, context_enc, continuation_enc in requests]

        def loglikelihood_rolling(self, requests: Any, disable_tqdm: bool = False) -> Any:
            raise NotImplementedError

        def generate_until(self, requests: Any, disable_tqdm: bool = False) -> Any:
            raise NotImplementedError

    request = instance.Instance("loglikelihood", {}, (context, continuation), 0)
    [expected] = Reference().loglikelihood([request], disable_tqdm=True)
    assert split_continuation(encode, context, continuation, tokenizer.bos_token_id) == expected


def test_continuation_rows_through_the_cli(random_models: dict[str, Path], tmp_path: Path) -> None:
    model_dir = tmp_path / "chat_model"
    shutil.copytree(random_models["llama"], model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    messages = [{"role": "user", "content": "Where does the fox jump?"}]
    rows = [
        {"id": "text", "prompt": "The quick brown fox jumps over the ", "continuation": "lazy dog"},
        {"id": "chat", "messages": messages, "continuation": "Over the lazy dog."},
        {"id": "gen", "prompt": "Once upon a", "continuation": " time", "max_tokens": 2, "temperature": 0},
        {"id": "both", "prompt": "a", "continuation": "b", "prompt_logprobs_from": 1},
        {"id": "ids", "prompt_token_ids": [0, 5], "continuation": "b"},
        {"id": "far", "prompt_token_ids": [0, 5], "prompt_logprobs_from": 2},
        {"id": "far-scored", "prompt_token_ids": [0, 5], "prompt_logprobs_from": 2, "max_new_tokens": 0},
        {"id": "off", "prompt_token_ids": [0, 5, 7], "prompt_logprobs_from": 1, "prompt_logprobs": False},
        {"id": "merged", "prompt": "the lazy d", "continuation": "og"},  # "d" + "og": one token, the prompt's
    ]
    code, output = run_cli(
        run_args(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "o.arrow", model_dir, "--dtype", "float32")
        + ["--on-error", "skip", "--no-progress"]
    )
    assert code == 0, output
    out = read_rows(tmp_path / "o.arrow")
    # The engine's prompts get the tokenizer's special tokens (BOS here), the chat template's text none.
    with_bos = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    plain = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    for rid, encode, context, continuation in [
        ("text", with_bos, "The quick brown fox jumps over the", " lazy dog"),
        ("chat", plain, rendered, "Over the lazy dog."),
    ]:
        context_ids = encode(context)
        ids = context_ids + encode(context + continuation)[len(context_ids) :]
        expected, greedy = hf_scores(model_dir, ids, len(context_ids))
        assert out[rid]["prompt_tokens"] == len(ids)
        assert out[rid]["prompt_logprobs"] == pytest.approx(expected, abs=1e-4), rid
        assert out[rid]["prompt_is_greedy"] is greedy and out[rid]["completion_tokens"] == 0
    assert out["gen"]["completion_tokens"] == 2 and len(out["gen"]["prompt_logprobs"]) >= 1
    assert "give either continuation or prompt_logprobs_from" in out["both"]["error"]
    assert "continuation" in out["ids"]["error"] and "prompt_token_ids" in out["ids"]["error"]
    assert "prompt_logprobs_from': asks for prompt logprobs, which prompt_logprobs: false" in out["off"]["error"]
    assert len(with_bos("the lazy dog")) == len(with_bos("the lazy d"))
    assert "continuation': has no token of its own" in out["merged"]["error"]
    for rid in ("far", "far-scored"):
        assert "must be less than the prompt's 2 tokens, got 2" in out[rid]["error"]
