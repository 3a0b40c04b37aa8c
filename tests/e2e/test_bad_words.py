"""vLLM's ``bad_words`` end to end: a greedy row's ids are HF float32's greedy ids with each word's last token banned
where the output ends with the word's other tokens (the word alone and after a space, as the tokenizer splits them);
the text never holds the word; speculative decoding (n-gram and draft model) gives the same ids."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from tests.helpers.cli import generate, run_args, run_cli, write_jsonl
from tests.helpers.hf_greedy import hf_model

NEW = 24
GREEDY = ("--temperature", "0", "--max-new-tokens", str(NEW))


def _hf_greedy_banning(model_dir: Path, prompt: str, words: list[str]) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = hf_model(model_dir)
    sequences = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(text)) for w in words for text in (w, " " + w)]
    ids = list(tokenizer(prompt)["input_ids"])
    out: list[int] = []
    while len(out) < NEW:
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0, -1]
        for seq in sequences:
            if len(seq) == 1 or out[len(out) - len(seq) + 1 :] == seq[:-1] and len(out) >= len(seq) - 1:
                logits[seq[-1]] = float("-inf")
        out.append(int(logits.argmax()))
        if out[-1] == tokenizer.eos_token_id:
            break
    return out


def test_bad_words_are_never_produced_and_greedy_is_hfs(random_models: dict[str, Path], tmp_path: Path) -> None:
    model = random_models["llama"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = "The quick brown fox"
    free = generate(
        write_jsonl(tmp_path / "f.jsonl", [{"id": "r", "prompt": prompt}]), tmp_path / "f.arrow", model, *GREEDY
    )
    pieces = [tokenizer.decode([t]) for t in free["r"]["output_token_ids"]]

    # Two words of the free run's text, in letters: one piece, and two pieces that follow each other.
    def letters(text: str) -> bool:
        return text.isascii() and text.strip().isalpha()

    single = next(piece.strip() for piece in pieces if letters(piece))
    pair = next((a + b).strip() for a, b in zip(pieces, pieces[1:]) if letters(a + b) and single not in a + b)
    words = [single, pair]
    assert all(words) and all(word in free["r"]["text"] for word in words), (pieces, words)
    rows = [{"id": "r", "prompt": prompt, "bad_words": words}]
    dataset = write_jsonl(tmp_path / "b.jsonl", rows)
    banned = generate(dataset, tmp_path / "b.arrow", model, *GREEDY)["r"]
    assert banned["output_token_ids"] == _hf_greedy_banning(model, prompt, words)
    assert banned["output_token_ids"] != free["r"]["output_token_ids"]
    assert not any(word in banned["text"] for word in words), (words, banned["text"])
    ngram = ("--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "4", "--speculative-ngram-min", "1")
    draft = ("--speculative-algorithm", "draft", "--speculative-draft-model", str(model))
    for spec in (ngram, draft):
        again = generate(dataset, tmp_path / "s.arrow", model, *GREEDY, *spec)["r"]
        assert again["output_token_ids"] == banned["output_token_ids"], spec


def test_a_word_of_only_whitespace_is_a_row_error(random_models: dict[str, Path], tmp_path: Path) -> None:
    rows = [{"id": "a", "prompt": "x", "bad_words": ["ok", " "]}, {"id": "b", "prompt": "x", "bad_words": 3}]
    dataset = write_jsonl(tmp_path / "p.jsonl", rows)
    code, output = run_cli(run_args(dataset, tmp_path / "o.arrow", random_models["llama"], *GREEDY))
    assert code == 3
    assert "p.jsonl:1: field 'bad_words': a bad word must hold more than whitespace" in output
    assert "p.jsonl:2: field 'bad_words': must be a string or a list of strings, got 3" in output
