"""Acceptance cases of ``../shared/cases/cases.md`` (B01 … B17): real faults of other engines, each with its right
value stated from outside batchgen — the literal values quoted in cases.md and/or an HF transformers float32
reference (one prompt alone, no padding) computed here.

Models: ``M-STORIES`` is the shared stories260k; ``M-RAND``, ``M-RAND-PAD`` and ``M-RAND-LAST`` are built below
exactly as cases.md describes (default ``LlamaConfig`` init, seed 0, the stories260k tokenizer files).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from tests.helpers.cli import generate, read_rows, run_args, run_cli, write_jsonl
from tests.helpers.models import GREEDY_REFERENCE, STORIES, needs_shared

# ---------------------------------------------------------------------------------------------------------------
# Literal values from cases.md
# ---------------------------------------------------------------------------------------------------------------

ONCE = "Once upon a time"
ONCE_IDS = [1, 403, 407, 261, 378]
# G: greedy M-STORIES continuation of ONCE (first 16 ids as quoted in cases.md).
G16 = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337]
G_TEXT = (
    ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball."
)
G_FIRST_TOP5 = [432, 383, 322, 353, 323]
G_FIRST_TOP5_LOGPROBS = [-0.032, -3.55, -8.121, -8.244, -8.697]

S15 = "Once upon a time, there was a little girl named Lily"
S16 = S15 + "."
S17 = S16 + " She"
S32 = S16 + " She loved to play outside in the park."
S33 = S32 + " One"
S62 = S32 + " One day, she saw a big, red ball. She wanted to play with it, but it was too high."
S63 = S62 + " Lily"
S64 = S62 + " Lily was"
S65 = S62 + " Lily a a"
S_LENGTHS = {S15: 15, S16: 16, S17: 17, S32: 32, S33: 33, S62: 62, S63: 63, S64: 64, S65: 65}

# Every case uses the stories260k model or its tokenizer files.
pytestmark = needs_shared

TOL = 1e-4  # logprob tolerance against HF and across runs
MIN_GAP = 1e-4  # a greedy reference step with a smaller top-2 gap is a near-tie: the input must avoid it

M_STORIES = "M-STORIES"
M_RAND = "M-RAND"

# ---------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _build_rand(out_dir: Path, vocab_size: int) -> Path:
    """``M-RAND`` (vocab 512) / ``M-RAND-PAD`` (vocab 576) exactly as cases.md describes."""
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
        vocab_size=vocab_size,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir)
    for name in _TOKENIZER_FILES:
        shutil.copy(STORIES / name, out_dir / name)
    return out_dir


def _copy_stories(out_dir: Path) -> Path:
    shutil.copytree(STORIES, out_dir, ignore=shutil.ignore_patterns("original"))
    return out_dir


def _edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("case_models")
    out = {
        M_STORIES: STORIES,
        M_RAND: _build_rand(root / "rand", 512),
        "M-RAND-PAD": _build_rand(root / "rand_pad", 576),
    }
    # M-RAND-LAST: M-RAND with lm_head rows t0 and 511 swapped, t0 = HF greedy first token for ONCE.
    rand = AutoModelForCausalLM.from_pretrained(out[M_RAND], dtype=torch.float32).eval()
    with torch.no_grad():
        t0 = int(rand(torch.tensor([ONCE_IDS])).logits[0, -1].argmax())
        weight = rand.lm_head.weight
        weight[[t0, 511]] = weight[[511, t0]].clone()
    last = root / "rand_last"
    rand.save_pretrained(last)
    for name in _TOKENIZER_FILES:
        shutil.copy(STORIES / name, last / name)
    out["M-RAND-LAST"] = last
    return out


# ---------------------------------------------------------------------------------------------------------------
# HF reference (float32, CPU, one prompt alone)
# ---------------------------------------------------------------------------------------------------------------

_HF: dict[str, Any] = {}


def hf_model(model_dir: Path) -> Any:
    key = str(model_dir)
    if key not in _HF:
        _HF[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _HF[key]


def hf_tokenizer(model_dir: Path) -> Any:
    key = "tok:" + str(model_dir)
    if key not in _HF:
        _HF[key] = AutoTokenizer.from_pretrained(model_dir)
    return _HF[key]


def encode(model_dir: Path, text: str) -> list[int]:
    return list(hf_tokenizer(model_dir)(text)["input_ids"])


@torch.no_grad()
def hf_logprobs(model_dir: Path, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> torch.Tensor:
    """Teacher-forced raw ``log_softmax`` ``[len(output_ids), vocab]``: row i is the distribution of output i."""
    ids = list(prompt_ids) + list(output_ids)
    logits = hf_model(model_dir)(torch.tensor([ids])).logits[0].float()
    n = len(prompt_ids)
    return torch.log_softmax(logits[n - 1 : n - 1 + len(output_ids)], dim=-1)


@torch.no_grad()
def hf_greedy(
    model_dir: Path, prompt_ids: Sequence[int], max_new: int, stop_ids: Sequence[int] = ()
) -> tuple[list[int], list[torch.Tensor]]:
    """Plain greedy decoding (argmax of the raw logits) until ``max_new`` tokens or a token in ``stop_ids``.

    Asserts the reference has no near-tie step (top-2 gap < MIN_GAP), as the cases' convention requires.
    """
    model = hf_model(model_dir)
    ids = list(prompt_ids)
    out: list[int] = []
    logprobs: list[torch.Tensor] = []
    for step in range(max_new):
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        top2 = lp.topk(2).values
        assert top2[0] - top2[1] > MIN_GAP, f"{model_dir.name}: reference near-tie at step {step}; pick another input"
        token = int(lp.argmax())
        out.append(token)
        logprobs.append(lp)
        ids.append(token)
        if token in stop_ids:
            break
    return out, logprobs


def continuation(model_dir: Path, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> str:
    """The cases' ``text`` convention: ``decode(prompt+output)`` minus its prefix ``decode(prompt)``."""
    tok = hf_tokenizer(model_dir)
    before = tok.decode(list(prompt_ids), skip_special_tokens=True)
    full = tok.decode(list(prompt_ids) + list(output_ids), skip_special_tokens=True)
    assert full.startswith(before), (before, full)
    return full[len(before) :]


# ---------------------------------------------------------------------------------------------------------------
# Running batchgen
# ---------------------------------------------------------------------------------------------------------------


def bg(tmp: Path, name: str, rows: list[dict[str, Any]], model: Path, *extra: str) -> dict[str, dict[str, Any]]:
    """Write ``rows`` to ``tmp/name.jsonl``, run batchgen on them (must succeed), return the output rows by id."""
    return generate(write_jsonl(tmp / f"{name}.jsonl", rows), tmp / f"{name}.arrow", model, *extra)


def bg_with_errors(
    tmp: Path, name: str, rows: list[dict[str, Any]], model: Path, *extra: str
) -> tuple[Path, str, dict[str, dict[str, Any]]]:
    """Like :func:`bg` for a file with bad rows: asserts exit code 3; returns (dataset, CLI output, rows by id)."""
    dataset = write_jsonl(tmp / f"{name}.jsonl", rows)
    out = tmp / f"{name}.arrow"
    code, output = run_cli(run_args(dataset, out, model, *extra))
    assert code == 3, output
    return dataset, output, read_rows(out)


def assert_row_error(output: str, dataset: Path, line: int, field: str, *fragments: str) -> None:
    """The one-line ``batchgen: error: <file>:<line>: field '<field>': <message>`` report of a bad row."""
    prefix = f"batchgen: error: {dataset}:{line}: field '{field}': "
    lines = [ln for ln in output.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, f"expected one error line starting {prefix!r} in:\n{output}"
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def assert_logprobs_match(got: dict[str, Any], ref: Sequence[torch.Tensor] | torch.Tensor, top: int = 0) -> None:
    """``output_logprobs`` (and the top-``top`` lists) of ``got`` equal the raw reference distributions."""
    rid = got["id"]
    ids = got["output_token_ids"]
    assert got["output_logprobs"] is not None and len(got["output_logprobs"]) == len(ids), rid
    for step, token in enumerate(ids):
        want = ref[step][token].item()
        assert abs(got["output_logprobs"][step] - want) < TOL, (rid, step, got["output_logprobs"][step], want)
    if top:
        assert got["top_logprobs"] is not None and len(got["top_logprobs"]) == len(ids), rid
        for step, entries in enumerate(got["top_logprobs"]):
            values, top_ids = ref[step].topk(top + 1)
            # The reference's top set must be unambiguous for an exact id comparison.
            assert values[top - 1] - values[top] > TOL, (rid, step, "reference tie at the top-k boundary")
            assert len(entries) == top, (rid, step, entries)
            got_lp = [e["logprob"] for e in entries]
            assert got_lp == sorted(got_lp, reverse=True), (rid, step, entries)
            want = dict(zip(top_ids[:top].tolist(), values[:top].tolist()))
            assert {e["id"] for e in entries} == set(want), (rid, step, entries, want)
            for e in entries:
                assert abs(e["logprob"] - want[e["id"]]) < TOL, (rid, step, e, want[e["id"]])


@pytest.fixture(scope="module")
def g_stories(models: dict[str, Path]) -> list[int]:
    """G: HF greedy continuation of ONCE on M-STORIES (64 tokens), checked against the quoted values."""
    ids, _ = hf_greedy(models[M_STORIES], ONCE_IDS, 64)
    assert encode(models[M_STORIES], ONCE) == ONCE_IDS
    assert ids[:16] == G16
    reference = json.loads(GREEDY_REFERENCE.read_text())["stories260k|float32"]
    assert ids[:40] == reference["new_ids"]
    assert continuation(models[M_STORIES], ONCE_IDS, ids[:40]) == G_TEXT
    return ids


# ---------------------------------------------------------------------------------------------------------------
# B01 — logprobs of one request change with batch size
# ---------------------------------------------------------------------------------------------------------------


def _b01_batch(probe: dict[str, Any]) -> list[dict[str, Any]]:
    """32 lines, the probe at line 17, prompts of 1..62 tokens with mixed sampling parameters."""
    words = S62.split(" ")
    prompts = [S15, S62, "", S33, S16, S32, S17]
    prompts += [" ".join(words[:k]) for k in range(1, len(words), 2)]
    params: list[dict[str, Any]] = [
        {"temperature": 0},
        {"temperature": 0.8},
        {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "logprobs": True, "top_logprobs": 3},
        {"temperature": 0.7, "min_p": 0.05, "stop": ["."]},
        {"temperature": 0, "min_new_tokens": 3, "logprobs": False},
        {"temperature": 1.2, "top_k": 5, "ignore_eos": True, "top_logprobs": 2},
    ]
    rows: list[dict[str, Any]] = []
    for i in range(31):
        row = {"id": f"r{i}", "prompt": prompts[i % len(prompts)], "max_new_tokens": 1 + (i * 7) % 40, "seed": i}
        row.update(params[i % len(params)])
        rows.append(row)
    rows.insert(16, probe)
    return rows


@pytest.mark.parametrize("model_name", [M_STORIES, M_RAND])
def test_b01_logprobs_do_not_depend_on_batch(
    model_name: str, models: dict[str, Path], g_stories: list[int], tmp_path: Path
) -> None:
    model = models[model_name]
    probe = {"id": "probe", "prompt": ONCE, "max_new_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 5}
    batch = _b01_batch(probe)
    assert len(batch) == 32 and batch[16]["id"] == "probe"
    lengths = {len(encode(model, r["prompt"])) for r in batch}
    assert min(lengths) == 1 and max(lengths) == 62

    alone = bg(tmp_path, "probe", [probe], model, "--max-running-requests", "1")["probe"]
    batched_rows = bg(tmp_path, "batch", batch, model, "--max-running-requests", "32")
    assert len(batched_rows) == 32
    batched = batched_rows["probe"]

    ref_ids, ref_lp = hf_greedy(model, ONCE_IDS, 16)
    if model_name == M_STORIES:
        assert ref_ids == G16
        top5 = ref_lp[0].topk(5)
        assert top5.indices.tolist() == G_FIRST_TOP5
        assert torch.allclose(top5.values, torch.tensor(G_FIRST_TOP5_LOGPROBS), atol=1e-3)
    for got in (alone, batched):
        assert got["output_token_ids"] == ref_ids
        assert_logprobs_match(got, ref_lp, top=5)
        if model_name == M_STORIES:
            assert [e["id"] for e in got["top_logprobs"][0]] == G_FIRST_TOP5
    for step in range(len(ref_ids)):
        assert abs(alone["output_logprobs"][step] - batched["output_logprobs"][step]) < TOL
        a = {e["id"]: e["logprob"] for e in alone["top_logprobs"][step]}
        b = {e["id"]: e["logprob"] for e in batched["top_logprobs"][step]}
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < TOL for k in a), step


# ---------------------------------------------------------------------------------------------------------------
# B03 — identical prompts in one batch give different greedy outputs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_name", [M_STORIES, M_RAND])
def test_b03_identical_prompts_identical_outputs(
    model_name: str, models: dict[str, Path], g_stories: list[int], tmp_path: Path
) -> None:
    model = models[model_name]
    rows = [{"id": f"d{i}", "prompt": ONCE, "max_new_tokens": 50, "temperature": 0, "logprobs": True} for i in range(4)]
    ref_ids, ref_lp = hf_greedy(model, ONCE_IDS, 50, stop_ids=[2])
    if model_name == M_STORIES:
        assert ref_ids == g_stories[:50]
    # batchgen has no prefix cache / page size yet: vary the settings that exist instead.
    settings = [
        ["--max-running-requests", "4"],
        ["--max-running-requests", "4", "--chunked-prefill-size", "0", "--disable-mixed-chunk"],
        ["--max-running-requests", "4", "--chunked-prefill-size", "3"],
    ]
    runs = [bg(tmp_path, f"dup{k}", rows, model, *flags) for k, flags in enumerate(settings)]
    for k, run in enumerate(runs):
        # Rows prefilled in the same round and decoded together: identical up to 1e-6. With 3-token chunks the
        # four prompts are split at different offsets, so their prefill arithmetic differs (B04's 1e-4 applies).
        row_tol = 1e-6 if k < 2 else 1e-4
        first = run["d0"]
        for i in range(4):
            got = run[f"d{i}"]
            assert got["output_token_ids"] == ref_ids, (got["id"], got["output_token_ids"])
            diff = max(abs(x - y) for x, y in zip(got["output_logprobs"], first["output_logprobs"], strict=True))
            assert diff <= row_tol, (got["id"], diff)
        # Across settings the prefill is split differently, so only B04's tolerance (1e-4, against HF) holds.
        assert_logprobs_match(run["d0"], ref_lp)


# ---------------------------------------------------------------------------------------------------------------
# B04 — chunked prefill changes the output
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_name", [M_STORIES, M_RAND])
def test_b04_chunked_prefill_does_not_change_output(model_name: str, models: dict[str, Path], tmp_path: Path) -> None:
    model = models[model_name]
    rows: list[dict[str, Any]] = []
    for prompt in (S15, S16, S17, S32, S33):
        assert len(encode(model, prompt)) == S_LENGTHS[prompt]
        rows.append(
            {"id": f"cp{S_LENGTHS[prompt]}", "prompt": prompt, "max_new_tokens": 12, "temperature": 0, "logprobs": True}
        )
    rows.append({"id": "dec", "prompt": "The sun was hot.", "max_new_tokens": 40, "temperature": 0})
    refs = {r["id"]: hf_greedy(model, encode(model, r["prompt"]), r["max_new_tokens"], stop_ids=[2]) for r in rows}
    settings = [
        ["--chunked-prefill-size", "16"],
        ["--chunked-prefill-size", "5"],
        ["--chunked-prefill-size", "5", "--disable-mixed-chunk"],
        ["--chunked-prefill-size", "0"],
        ["--chunked-prefill-size", "16", "--max-running-requests", "1"],
    ]
    runs = [bg(tmp_path, f"chunk{k}", rows, model, *flags) for k, flags in enumerate(settings)]
    for k, run in enumerate(runs):
        for row in rows:
            got = run[row["id"]]
            ref_ids, ref_lp = refs[row["id"]]
            assert got["output_token_ids"] == ref_ids, (settings[k], row["id"], got["output_token_ids"], ref_ids)
            assert_logprobs_match(got, ref_lp)
            for other in runs[:k]:
                diff = [abs(a - b) for a, b in zip(got["output_logprobs"], other[row["id"]]["output_logprobs"])]
                assert max(diff) < TOL, (settings[k], row["id"])


# ---------------------------------------------------------------------------------------------------------------
# B05 — stop string inside a token, at the very start, or only with the prompt
# ---------------------------------------------------------------------------------------------------------------


def test_b05_stop_strings_stories(models: dict[str, Path], g_stories: list[int], tmp_path: Path) -> None:
    model = models[M_STORIES]
    base = {"prompt": ONCE, "max_new_tokens": 40, "temperature": 0}
    rows = [
        {"id": "s_inside", **base, "stop": ["nam"]},
        {"id": "s_first", **base, "stop": [","]},
        {"id": "s_prompt", **base, "stop": ["time,"]},
        {"id": "nostop", **base},
    ]
    got = bg(tmp_path, "stops", rows, model)
    inside = got["s_inside"]
    assert inside["text"] == ", there was a little girl "
    assert inside["finish_reason"] == "stop" and inside["matched_stop"] == "nam"
    assert inside["output_token_ids"] == g_stories[:9] and inside["output_token_ids"][-1] == 395
    first = got["s_first"]
    assert first["text"] == "" and first["output_token_ids"] == [432]
    assert first["finish_reason"] == "stop" and first["matched_stop"] == ","
    in_prompt = got["s_prompt"]
    assert in_prompt["output_token_ids"] == g_stories[:40] and in_prompt["finish_reason"] == "length"
    assert in_prompt["matched_stop"] is None
    assert got["nostop"]["text"] == G_TEXT and in_prompt["text"] == got["nostop"]["text"]


def _first_stop(
    model: Path, prompt_ids: list[int], ids: list[int], stops: Sequence[str]
) -> tuple[list[int], str] | None:
    """Where a stop string first appears as the continuation text grows token by token: (the ids up to and
    including the token that completed it, the text before it), or ``None`` when no stop appears."""
    for k in range(1, len(ids) + 1):
        text = continuation(model, prompt_ids, ids[:k])
        found = [pos for pos in (text.find(s) for s in stops) if pos != -1]
        if found:
            return ids[:k], text[: min(found)]
    return None


def test_b05_stop_string_inside_token_model_independent(models: dict[str, Path], tmp_path: Path) -> None:
    """From a greedy run take a token at position >= 2 whose text has >= 3 chars; stop at its first 2 and 3 chars."""
    model = models[M_RAND]
    ref_ids, _ = hf_greedy(model, ONCE_IDS, 40, stop_ids=[2])

    tok = hf_tokenizer(model)

    def token_text(i: int) -> str:
        """The text of a (non-byte) token: its SentencePiece piece with the word-boundary mark dropped."""
        piece = tok.convert_ids_to_tokens(ref_ids[i])
        return "" if piece.startswith("<") else piece.replace("▁", " ").strip()

    position = next((i for i in range(2, len(ref_ids)) if len(token_text(i)) >= 3), None)
    assert position is not None, "no multi-character token in the greedy run; pick another input"
    piece = token_text(position)
    rows = [{"id": "full", "prompt": ONCE, "max_new_tokens": 40, "temperature": 0}]
    for n in (2, 3):
        rows.append({"id": f"stop{n}", "prompt": ONCE, "max_new_tokens": 40, "temperature": 0, "stop": [piece[:n]]})
    got = bg(tmp_path, "stops_rand", rows, model)
    assert got["full"]["output_token_ids"] == ref_ids
    for n in (2, 3):
        expected = _first_stop(model, ONCE_IDS, ref_ids, [piece[:n]])
        assert expected is not None
        want_ids, want_text = expected
        assert len(want_ids) <= position + 1
        row = got[f"stop{n}"]
        assert row["output_token_ids"] == want_ids, (piece[:n], row["output_token_ids"], want_ids)
        assert row["finish_reason"] == "stop" and row["matched_stop"] == piece[:n]
        assert row["text"] == want_text


# ---------------------------------------------------------------------------------------------------------------
# B07 — min_new_tokens ignored when a stop string appears early
# ---------------------------------------------------------------------------------------------------------------


def test_b07_min_new_tokens_holds_back_stop_strings(
    models: dict[str, Path], g_stories: list[int], tmp_path: Path
) -> None:
    rows = [
        {
            "id": "m",
            "prompt": ONCE,
            "stop": ["."],
            "min_new_tokens": 15,
            "max_new_tokens": 40,
            "temperature": 0,
        }
    ]
    got = bg(tmp_path, "min_stop", rows, models[M_STORIES])["m"]
    assert got["text"] == ", there was a little girl named Lily. She loved to play outside in the park"
    assert got["finish_reason"] == "stop" and got["matched_stop"] == "."
    ids = got["output_token_ids"]
    assert len(ids) >= 15 and ids == g_stories[: len(ids)]


# ---------------------------------------------------------------------------------------------------------------
# B09 — min_new_tokens with a list of EOS ids, and off-by-one
# ---------------------------------------------------------------------------------------------------------------


def test_b09_min_new_tokens_with_eos_list(models: dict[str, Path], g_stories: list[int], tmp_path: Path) -> None:
    model = _copy_stories(tmp_path / "stories_eos_list")
    _edit_json(model / "generation_config.json", lambda d: d.update(eos_token_id=[2, 426]))
    rows = [
        {"id": "k0", "prompt": ONCE, "max_new_tokens": 40, "temperature": 0},
        {"id": "k10", "prompt": ONCE, "min_new_tokens": 10, "max_new_tokens": 40, "temperature": 0},
        {"id": "k11", "prompt": ONCE, "min_new_tokens": 11, "max_new_tokens": 40, "temperature": 0},
    ]
    got = bg(tmp_path, "eos_list", rows, model)
    hf = hf_model(model)
    assert hf.generation_config.eos_token_id == [2, 426]
    for row in rows:
        ref = hf.generate(
            torch.tensor([ONCE_IDS]),
            attention_mask=torch.ones(1, len(ONCE_IDS), dtype=torch.long),
            do_sample=False,
            max_new_tokens=40,
            min_new_tokens=row.get("min_new_tokens", 0),
        )[0, len(ONCE_IDS) :].tolist()
        out = got[row["id"]]
        assert out["output_token_ids"] == ref, (row["id"], out["output_token_ids"], ref)
        assert out["finish_reason"] == "stop" and out["matched_stop"] == "426", row["id"]
        assert not {2, 426} & set(out["output_token_ids"][: row.get("min_new_tokens", 0)])
    for rid in ("k0", "k10"):
        assert got[rid]["output_token_ids"] == g_stories[:11] and g_stories[10] == 426
    k11 = got["k11"]
    assert len(k11["output_token_ids"]) == 23 and k11["output_token_ids"][-1] == 426
    assert k11["output_token_ids"][:10] == g_stories[:10]
    # The stop token's text is not in `text` (cases.md conventions: stop strings and stop tokens follow the
    # OpenAI/vLLM defaults, "the stop text is not in `text`"); 426 is "." and not a special token.
    texts = {rid: got[rid]["text"] for rid in ("k0", "k10", "k11")}
    assert texts == {
        "k0": ", there was a little girl named Lily",
        "k10": ", there was a little girl named Lily",
        "k11": ", there was a little girl named Lily who loved to play with her toys",
    }


# ---------------------------------------------------------------------------------------------------------------
# B10 — ignore_eos not honoured / suppresses the wrong token
# ---------------------------------------------------------------------------------------------------------------

_B10_ROWS: list[dict[str, Any]] = [
    {"id": "ie", "prompt": ONCE, "ignore_eos": True, "max_new_tokens": 24, "temperature": 0},
    {"id": "ie_min", "prompt": ONCE, "ignore_eos": True, "min_new_tokens": 4, "max_new_tokens": 24, "temperature": 0},
    {"id": "neg", "prompt": ONCE, "stop_token_ids": [-1], "max_new_tokens": 4},
]


def test_b10_ignore_eos_stories_eos_261(models: dict[str, Path], g_stories: list[int], tmp_path: Path) -> None:
    model = _copy_stories(tmp_path / "stories_eos261")
    for name in ("config.json", "generation_config.json"):
        _edit_json(model / name, lambda d: d.update(eos_token_id=261))
    rows = [*_B10_ROWS, {"id": "no_ie", "prompt": ONCE, "max_new_tokens": 24, "temperature": 0}]
    dataset, output, got = bg_with_errors(tmp_path, "ignore_eos", rows, model)
    assert_row_error(output, dataset, 3, "stop_token_ids", "-1")
    assert set(got) == {"ie", "ie_min", "no_ie"}
    assert g_stories[3] == 261
    for rid in ("ie", "ie_min"):
        assert got[rid]["output_token_ids"] == g_stories[:24], rid
        assert got[rid]["finish_reason"] == "length", rid
    no_ie = got["no_ie"]
    assert no_ie["output_token_ids"] == g_stories[:4]
    assert no_ie["finish_reason"] == "stop" and no_ie["matched_stop"] == "261"


def test_b10_ignore_eos_does_not_mask_last_vocab_token(models: dict[str, Path], tmp_path: Path) -> None:
    model = models["M-RAND-LAST"]
    ref_ids, _ = hf_greedy(model, ONCE_IDS, 24)
    assert ref_ids[0] == 511
    dataset, output, got = bg_with_errors(tmp_path, "last_token", _B10_ROWS, model)
    assert_row_error(output, dataset, 3, "stop_token_ids", "-1")
    assert set(got) == {"ie", "ie_min"}
    for rid in ("ie", "ie_min"):
        assert got[rid]["output_token_ids"] == ref_ids, (rid, got[rid]["output_token_ids"], ref_ids)
        assert got[rid]["finish_reason"] == "length"


# ---------------------------------------------------------------------------------------------------------------
# B11 — U+FFFD in output text for characters split across tokens
# ---------------------------------------------------------------------------------------------------------------
# The `emoji` row of cases.md forces "🙂🙂 é" with a `regex` constraint, which batchgen does not implement yet
# (a later issue); without constrained decoding (or a logit bias) there is no way to force given byte tokens as
# *output* on M-STORIES, so that part is left out here. What is tested is the fault kind: for sampled rows full of
# byte tokens (random models at temperature 1.0, and M-STORIES continuing a prompt of emoji byte tokens) `text`
# equals the continuation part of the full decode exactly, through every detokenization path: no stop string (one
# decode at the end), a stop string that never matches (incremental detokenizer running, final text at the end),
# and stop strings that do match (text cut where the stop first appears in the growing full decode).

NEVER_STOP = "\u0000zz"
RARE_STOPS = ["q", "z", "!"]  # stop strings that appear somewhere in most random outputs, after byte tokens


@pytest.mark.parametrize("model_name", [M_RAND, "M-RAND-PAD"])
def test_b11_text_equals_full_decode_random_models(model_name: str, models: dict[str, Path], tmp_path: Path) -> None:
    model = models[model_name]
    rows: list[dict[str, Any]] = []
    for seed in range(20):
        base = {"prompt": ONCE, "temperature": 1.0, "seed": seed, "max_new_tokens": 64, "ignore_eos": True}
        rows.append({"id": f"rand{seed}", **base})
        rows.append({"id": f"rand{seed}_stop", **base, "stop": [NEVER_STOP]})
        rows.append({"id": f"rand{seed}_cut", **base, "stop": RARE_STOPS})
    got = bg(tmp_path, "bytes", rows, model)
    assembled = cuts = padded_ids = 0
    wrong_cut_texts: list[tuple[str, str, str]] = []
    for seed in range(20):
        plain, stopped = got[f"rand{seed}"], got[f"rand{seed}_stop"]
        ids = plain["output_token_ids"]
        assert len(ids) == 64 and plain["finish_reason"] == "length"
        assert stopped["output_token_ids"] == ids and stopped["finish_reason"] == "length"
        want = continuation(model, ONCE_IDS, ids)
        assert plain["text"] == want, (plain["id"], plain["text"], want)
        assert stopped["text"] == want, (stopped["id"], stopped["text"], want)
        assembled += any(ord(c) >= 0x80 and c != "\ufffd" for c in want)
        # A stop string that does match: cut where it first appears in the growing full decode.
        cut = got[f"rand{seed}_cut"]
        expected = _first_stop(model, ONCE_IDS, ids, RARE_STOPS)
        if expected is None:
            assert cut["output_token_ids"] == ids and cut["text"] == want and cut["finish_reason"] == "length"
        else:
            cut_ids, cut_text = expected
            cuts += 1
            assert cut["output_token_ids"] == cut_ids, cut["id"]
            assert cut["finish_reason"] == "stop" and cut["matched_stop"] in RARE_STOPS, cut["id"]
            if cut["text"] != cut_text:
                wrong_cut_texts.append((cut["id"], cut["text"], cut_text))
        padded_ids += sum(t >= 512 for t in ids)
    assert cuts > 0, "no row met a stop string"
    assert assembled > 0, "no multi-byte character assembled from byte tokens; the input does not test the kind"
    if model_name == "M-RAND-PAD":
        assert padded_ids > 0, "no id past the tokenizer's vocabulary was sampled"
    assert not wrong_cut_texts, (
        f"{len(wrong_cut_texts)}/{cuts} stop-cut texts differ from the full decode (got, want): {wrong_cut_texts}"
    )


def test_b11_text_equals_full_decode_stories_byte_prompt(models: dict[str, Path], tmp_path: Path) -> None:
    model = models[M_STORIES]
    prompt_ids = encode(model, "Once upon a time 🙂🙂 é 日本語 🙂")
    assert {243, 162, 156, 133} <= set(prompt_ids)
    rows: list[dict[str, Any]] = []
    for seed in range(10):
        base = {"prompt_token_ids": prompt_ids, "temperature": 1.5, "seed": seed, "max_new_tokens": 32}
        rows.append({"id": f"b{seed}", **base, "ignore_eos": True})
        rows.append({"id": f"b{seed}_stop", **base, "ignore_eos": True, "stop": [NEVER_STOP]})
    got = bg(tmp_path, "stories_bytes", rows, model)
    for seed in range(10):
        ids = got[f"b{seed}"]["output_token_ids"]
        assert got[f"b{seed}_stop"]["output_token_ids"] == ids
        want = continuation(model, prompt_ids, ids)
        assert got[f"b{seed}"]["text"] == want, seed
        assert got[f"b{seed}_stop"]["text"] == want, seed


# ---------------------------------------------------------------------------------------------------------------
# B13 — empty prompt
# ---------------------------------------------------------------------------------------------------------------


def test_b13_empty_prompt_with_bos(models: dict[str, Path], g_stories: list[int], tmp_path: Path) -> None:
    model = models[M_STORIES]
    assert encode(model, "") == [1]
    rows = [
        {"id": "empty", "prompt": "", "max_new_tokens": 8, "temperature": 0},
        {"id": "ok", "prompt": ONCE, "max_new_tokens": 8, "temperature": 0},
        {"id": "empty_ids", "prompt_token_ids": [], "max_new_tokens": 8, "temperature": 0},
    ]
    dataset, output, got = bg_with_errors(tmp_path, "empty_bos", rows, model)
    assert_row_error(output, dataset, 3, "prompt_token_ids")
    assert set(got) == {"empty", "ok"}
    ref_ids, _ = hf_greedy(model, [1], 8)
    assert ref_ids == [403, 407, 261, 378, 432, 383, 286, 261]
    assert got["empty"]["output_token_ids"] == ref_ids
    assert got["empty"]["text"] == "Once upon a time, there was a"
    assert got["ok"]["output_token_ids"] == g_stories[:8]


def test_b13_empty_prompt_without_bos(models: dict[str, Path], g_stories: list[int], tmp_path: Path) -> None:
    model = _copy_stories(tmp_path / "stories_nobos")

    def no_bos_post_processor(d: dict[str, Any]) -> None:
        d["post_processor"]["single"] = [{"Sequence": {"id": "A", "type_id": 0}}]
        d["post_processor"]["pair"] = [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}]

    _edit_json(model / "tokenizer.json", no_bos_post_processor)
    _edit_json(model / "tokenizer_config.json", lambda d: d.update(add_bos_token=False))
    assert encode(model, "") == []
    assert encode(model, ONCE) == ONCE_IDS[1:]
    rows = [
        {"id": "empty", "prompt": "", "max_new_tokens": 8, "temperature": 0},
        {"id": "ok", "prompt": ONCE, "max_new_tokens": 8, "temperature": 0},
        {"id": "ok_bos", "prompt_token_ids": ONCE_IDS, "max_new_tokens": 8, "temperature": 0},
    ]
    dataset, output, got = bg_with_errors(tmp_path, "empty_nobos", rows, model)
    assert_row_error(output, dataset, 1, "prompt", "empty")
    assert set(got) == {"ok", "ok_bos"}
    assert got["ok"]["output_token_ids"] == hf_greedy(model, ONCE_IDS[1:], 8, stop_ids=[2])[0]
    assert got["ok_bos"]["output_token_ids"] == g_stories[:8]


# ---------------------------------------------------------------------------------------------------------------
# B14 — prompt at or beyond the context length
# ---------------------------------------------------------------------------------------------------------------


def test_b14_context_length_boundary(models: dict[str, Path], tmp_path: Path) -> None:
    model = models[M_STORIES]
    rows = [
        {"id": "c62", "prompt": S62, "max_new_tokens": 2, "temperature": 0},
        {"id": "c63", "prompt": S63, "max_new_tokens": 1, "temperature": 0},
        {"id": "c63x", "prompt": S63, "max_new_tokens": 5, "temperature": 0},
        {"id": "c64", "prompt": S64, "max_new_tokens": 1, "temperature": 0},
        {"id": "c65", "prompt": S65, "max_new_tokens": 1, "temperature": 0},
    ]
    for prompt in (S62, S63, S64, S65):
        assert len(encode(model, prompt)) == S_LENGTHS[prompt]
    dataset, output, got = bg_with_errors(tmp_path, "context", rows, model, "--context-length", "64")
    assert_row_error(output, dataset, 4, "prompt", "64", "context length 64")
    assert_row_error(output, dataset, 5, "prompt", "65", "context length 64")
    assert set(got) == {"c62", "c63", "c63x"}
    assert got["c62"]["output_token_ids"] == hf_greedy(model, encode(model, S62), 2)[0]
    greedy63 = hf_greedy(model, encode(model, S63), 1)[0]
    for rid in ("c63", "c63x"):
        assert got[rid]["output_token_ids"] == greedy63, rid
        assert got[rid]["finish_reason"] == "length", rid
        assert got[rid]["prompt_tokens"] + got[rid]["completion_tokens"] <= 64


# ---------------------------------------------------------------------------------------------------------------
# B15 — max_new_tokens = 0 and 1
# ---------------------------------------------------------------------------------------------------------------


def test_b15_max_new_tokens_zero_and_one(models: dict[str, Path], tmp_path: Path) -> None:
    model = models[M_STORIES]
    rows = [
        {"id": "z0", "prompt": ONCE, "max_new_tokens": 0, "logprobs": True},
        {"id": "z1", "prompt": ONCE, "max_new_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": 3},
    ]
    got = bg(tmp_path, "zero_one", rows, model)
    z0 = got["z0"]
    assert z0["output_token_ids"] == [] and z0["text"] == "" and z0["finish_reason"] == "length"
    assert z0["completion_tokens"] == 0
    z1 = got["z1"]
    assert z1["output_token_ids"] == [432] and z1["text"] == "," and z1["finish_reason"] == "length"
    assert abs(z1["output_logprobs"][0] - (-0.032)) < 1e-3
    assert [e["id"] for e in z1["top_logprobs"][0]] == [432, 383, 322]
    assert_logprobs_match(z1, hf_logprobs(model, ONCE_IDS, [432]), top=3)


# ---------------------------------------------------------------------------------------------------------------
# B16 — reported logprobs depend on temperature / top-p
# ---------------------------------------------------------------------------------------------------------------


def test_b16_logprobs_are_raw(models: dict[str, Path], tmp_path: Path) -> None:
    model = models[M_STORIES]
    prompt = "Lily and Ben went to the park."
    common = {"prompt": prompt, "max_new_tokens": 6, "logprobs": True, "top_logprobs": 3}
    # The sampled rows ignore EOS: their 6 tokens are counted, and a seed's draws differ between CPUs.
    rows = [
        {"id": "t05", **common, "temperature": 0.5, "seed": 1, "ignore_eos": True},
        {"id": "t10", **common, "temperature": 1.0, "top_p": 0.5, "top_k": 2, "seed": 1, "ignore_eos": True},
        {"id": "t00", **common, "temperature": 0},
    ]
    got = bg(tmp_path, "raw_logprobs", rows, model)
    prompt_ids = encode(model, prompt)
    for row in rows:
        out = got[row["id"]]
        assert len(out["output_token_ids"]) == 6
        assert_logprobs_match(out, hf_logprobs(model, prompt_ids, out["output_token_ids"]), top=3)
    t00 = got["t00"]
    assert t00["output_token_ids"][0] == 342
    assert abs(t00["output_logprobs"][0] - (-0.14365)) < 1e-4
    assert t00["output_token_ids"] == hf_greedy(model, prompt_ids, 6)[0]


# ---------------------------------------------------------------------------------------------------------------
# B17 — top-p truncation collapses top_logprobs
# ---------------------------------------------------------------------------------------------------------------


def test_b17_top_logprobs_ignore_top_p(models: dict[str, Path], tmp_path: Path) -> None:
    model = models[M_STORIES]
    prompt = "Lily was happy. The end."
    rows = [
        {
            "id": "tp",
            "prompt": prompt,
            "temperature": 1.0,
            "top_p": 0.3,
            "seed": 3,
            "max_new_tokens": 4,
            "ignore_eos": True,  # its 4 tokens are counted; "The end." may well sample EOS on another CPU
            "logprobs": True,
            "top_logprobs": 3,
        }
    ]
    out = bg(tmp_path, "top_p", rows, model)["tp"]
    ids = out["output_token_ids"]
    assert len(ids) == 4
    for step, entries in enumerate(out["top_logprobs"]):
        assert len(entries) == 3, step
        assert len({e["id"] for e in entries}) == 3, step
        values = [e["logprob"] for e in entries]
        assert values == sorted(values, reverse=True), step
    first = out["top_logprobs"][0]
    assert [e["id"] for e in first] == [317, 338, 410]
    assert torch.allclose(
        torch.tensor([e["logprob"] for e in first]), torch.tensor([-1.553, -1.611, -2.174]), atol=1e-3
    )
    assert all(lp < 0 for lp in out["output_logprobs"])
    assert_logprobs_match(out, hf_logprobs(model, encode(model, prompt), ids), top=3)
