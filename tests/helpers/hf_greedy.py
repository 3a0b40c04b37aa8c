"""HF transformers' float32 greedy continuation as the reference of batchgen's rows: shared by the greedy
equivalence tests of every attention path."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

MAX_NEW = 10


def greedy_prompts(vocab: int) -> list[dict[str, Any]]:
    """Greedy rows of every length up to 63 tokens (random ids after BOS 0, ``vocab`` ids) and one text row."""
    rng = random.Random(7)
    rows: list[dict[str, Any]] = []
    lengths = [1, 2, 3, 5, 8, 15, 16, 17, 24, 31, 32, 33, 40, 47, 55, 63]
    for i, n in enumerate(lengths):
        ids = [0] + [rng.randrange(2, vocab) for _ in range(n - 1)]
        rows.append(
            {"id": f"p{i}", "prompt_token_ids": ids, "max_new_tokens": MAX_NEW, "temperature": 0, "top_logprobs": 3}
        )
    rows.append({"id": "text", "prompt": "Once upon a time there was", "max_new_tokens": MAX_NEW, "temperature": 0})
    return rows


def _hf_reference(model_dir: Path, prompt_ids: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    model = hf_model(model_dir)
    out = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=MAX_NEW,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
    )
    new_ids = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
    return new_ids, logprobs


_HF_CACHE: dict[Path, Any] = {}


def hf_model(model_dir: Path) -> Any:
    """HF transformers' float32 model of ``model_dir``, loaded once per test process."""
    if model_dir not in _HF_CACHE:
        _HF_CACHE[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _HF_CACHE[model_dir]


def check_against_hf(model_dir: Path, rows: list[dict[str, Any]], results: dict[str, dict[str, Any]]) -> None:
    """Each row's greedy tokens equal HF transformers' float32 ``generate``, their logprobs and top 3 within 1e-4."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for row in rows:
        prompt_ids = row.get("prompt_token_ids") or tokenizer(row["prompt"])["input_ids"]
        ref_ids, ref_logprobs = _hf_reference(model_dir, prompt_ids)
        got = results[row["id"]]
        for step, lp in enumerate(ref_logprobs[: len(ref_ids)]):
            top2 = lp.topk(2).values
            assert top2[0] - top2[1] > 1e-4, f"{row['id']} step {step}: reference near-tie, pick another input"
        assert got["output_token_ids"] == ref_ids, row["id"]
        for step, token in enumerate(ref_ids):
            assert abs(got["output_logprobs"][step] - ref_logprobs[step][token].item()) < 1e-4, (row["id"], step)
        if row.get("top_logprobs"):
            for step, top in enumerate(got["top_logprobs"]):
                values, ids = ref_logprobs[step].topk(3)
                assert [t["id"] for t in top] == ids.tolist(), (row["id"], step)
                assert torch.allclose(torch.tensor([t["logprob"] for t in top]), values, atol=1e-4)


def hf_constrained_greedy(
    model_dir: Path, prompt: str, grammar: tuple[str, str], end_ids: list[int], max_new: int, bias: dict[int, float]
) -> list[int]:
    """HF float32 greedy decoding of ``prompt`` under ``grammar`` (``("regex", PATTERN)`` or ``("ebnf", GRAMMAR)``),
    masked by xgrammar's own matcher told ``end_ids``, with ``bias`` added to the logits; the ids up to and with the
    end id that terminates the grammar."""
    import xgrammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = hf_model(model_dir)
    vocab = model.config.vocab_size
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    kind, source = grammar
    compiled = compiler.compile_regex(source) if kind == "regex" else compiler.compile_grammar(source)
    matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=end_ids)
    ids = list(tokenizer(prompt)["input_ids"])
    out: list[int] = []
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    while not matcher.is_terminated():
        assert len(out) < max_new, out
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[:, -1].float()
        for token_id, value in bias.items():
            logits[0, token_id] += value
        matcher.fill_next_token_bitmask(bitmask)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask)
        out.append(int(logits.argmax()))
        assert matcher.accept_token(out[-1])
    return out
