"""The sampling pipeline: distributions (chi-square against the exact distribution computed here), penalties
against HF and hand-written references, logit bias, seeds, tiny temperatures, processed logprobs."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchgen.sampling.penalties import TokenHistory
from batchgen.sampling.sampler import SampleOutput, sample
from batchgen.sampling.sampling_batch_info import SamplingBatchInfo
from batchgen.sampling.sampling_params import SamplingParams
from tests.helpers.cli import generate, run_args, run_cli, write_jsonl
from tests.helpers.models import STORIES, needs_shared

VOCAB = 12
LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.2, 0.0, -0.3, -1.0, -2.0, 0.8, 1.4])
DRAWS = 6000


def _expected(params: SamplingParams, counts: Counter[int] | None = None) -> np.ndarray:
    """The exact next-token distribution, written independently of batchgen with numpy."""
    logits = LOGITS.double().numpy().copy()
    if counts:
        for token, count in counts.items():
            logits[token] -= params.frequency_penalty * count + params.presence_penalty
    if params.allowed_token_ids is not None:
        logits[[i for i in range(VOCAB) if i not in params.allowed_token_ids]] = -np.inf
    logits = logits / params.temperature
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    if 0 < params.top_k < VOCAB:
        kth = np.sort(probs)[::-1][params.top_k - 1]
        probs = np.where(probs >= kth, probs, 0.0)
        probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        keep = np.zeros(VOCAB, dtype=bool)
        keep[order[before < params.top_p]] = True
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    if params.min_p > 0:
        probs = np.where(probs >= params.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6),
        SamplingParams(temperature=1.3, top_k=4),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=1.0, min_p=0.3),
        SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.1),
        SamplingParams(temperature=1.0, frequency_penalty=0.7, presence_penalty=0.4),
        SamplingParams(temperature=1.0, allowed_token_ids=(1, 4, 10)),
        SamplingParams(temperature=0.7, top_k=2, allowed_token_ids=(1, 4, 8, 10)),
    ],
    ids=["t1", "t0.6", "topk", "topp", "minp", "combined", "penalties", "allowed", "allowed-topk"],
)
def test_sampled_distribution_matches_exact(params: SamplingParams) -> None:
    counts = Counter({0: 3, 1: 1}) if params.frequency_penalty else None
    history = TokenHistory(frozenset(), counts or Counter())
    info = SamplingBatchInfo.from_params(
        [params] * DRAWS,
        seeds=list(range(DRAWS)),
        steps=[5] * DRAWS,
        banned=[[]] * DRAWS,
        vocab_size=VOCAB,
        device=torch.device("cpu"),
        histories=[history if counts else None] * DRAWS,
    )
    drawn = sample(LOGITS.expand(DRAWS, VOCAB).clone(), info).next_token_ids
    observed = np.bincount(drawn.numpy(), minlength=VOCAB)
    expected = _expected(params, counts)
    assert observed[expected == 0].sum() == 0, "a token outside the truncated support was drawn"
    support = expected > 0
    p_value = chisquare(observed[support], expected[support] * DRAWS).pvalue
    assert p_value > 1e-3, (observed, expected * DRAWS)


def test_same_seed_and_position_give_the_same_token_anywhere_in_the_batch() -> None:
    params = [SamplingParams(temperature=1.0)] * 3
    out_a = sample(
        LOGITS.expand(3, VOCAB).clone(),
        SamplingBatchInfo.from_params(params, [7, 8, 9], [3, 3, 3], [[]] * 3, VOCAB, torch.device("cpu")),
    ).next_token_ids
    out_b = sample(
        LOGITS.expand(3, VOCAB).clone(),
        SamplingBatchInfo.from_params(params, [9, 7, 8], [3, 3, 3], [[]] * 3, VOCAB, torch.device("cpu")),
    ).next_token_ids
    assert out_a.tolist() == [out_b[1].item(), out_b[2].item(), out_b[0].item()]


def test_logit_bias_forces_and_bans_tokens() -> None:
    params = [
        SamplingParams(temperature=0.0, logit_bias=((9, 100.0),)),
        SamplingParams(temperature=0.0, logit_bias=((0, -100.0),)),
    ]
    out = sample(
        LOGITS.expand(2, VOCAB).clone(),
        SamplingBatchInfo.from_params(params, [0, 1], [0, 0], [[]] * 2, VOCAB, torch.device("cpu")),
    )
    assert out.next_token_ids.tolist() == [9, 1]
    # Raw logprobs ignore the bias (they describe the model).
    raw = torch.log_softmax(LOGITS, dim=-1)
    assert torch.allclose(out.logprobs, torch.stack([raw[9], raw[1]]))


def test_allowed_token_ids_limit_greedy_rows_to_them() -> None:
    """vLLM's allowed_token_ids: the argmax among the listed ids (LOGITS: id 10's 0.8 above id 4's 0.5), a bias on an
    id outside them changes nothing, and a row without the field in the same round keeps the whole vocabulary."""
    params = [
        SamplingParams(temperature=0.0, allowed_token_ids=(4, 10)),
        SamplingParams(temperature=0.0, allowed_token_ids=(4, 10), logit_bias=((0, 100.0), (4, 1.0))),
        SamplingParams(temperature=0.0),
    ]
    out = sample(
        LOGITS.expand(3, VOCAB).clone(),
        SamplingBatchInfo.from_params(params, [0, 1, 2], [0, 0, 0], [[]] * 3, VOCAB, torch.device("cpu")),
    )
    assert out.next_token_ids.tolist() == [10, 4, 0]
    raw = torch.log_softmax(LOGITS, dim=-1)  # raw logprobs describe the model, not the limit
    assert torch.allclose(out.logprobs, torch.stack([raw[10], raw[4], raw[0]]))


def test_limits_that_leave_a_row_no_token_give_way_in_order() -> None:
    """Found by a helper: bad words banning the only allowed id, or allowed ids the grammar takes none of, left a row
    all -inf and token 0 came out. The bans give way first (row 0: its one allowed id, which a bad word bans), then
    the allowed ids to the grammar (row 1: ids 1 and 2 allowed by the grammar, id 3 by the row: LOGITS' 1.5 > 1.2)."""
    from batchgen.sampling.grammar import pack_bits

    params = [SamplingParams(temperature=0.0, allowed_token_ids=ids) for ids in ((4,), (3,))]
    info = SamplingBatchInfo.from_params(
        params, [0, 1], [0, 0], [[], []], VOCAB, torch.device("cpu"), bad_words=[[4], []]
    )
    grammar = torch.zeros(VOCAB, dtype=torch.bool)
    grammar[[1, 2]] = True
    info.grammar_mask = torch.stack([pack_bits(torch.ones(VOCAB, dtype=torch.bool)), pack_bits(grammar)])
    assert sample(LOGITS.expand(2, VOCAB).clone(), info).next_token_ids.tolist() == [4, 1]


def test_processed_logprobs_follow_temperature() -> None:
    params = [SamplingParams(temperature=0.5, top_logprobs=2)]
    info = SamplingBatchInfo.from_params(params, [1], [0], [[]], VOCAB, torch.device("cpu"), processed_logprobs=True)
    out = sample(LOGITS[None].clone(), info)
    expected = torch.log_softmax(LOGITS / 0.5, dim=-1)
    assert torch.allclose(out.logprobs, expected[out.next_token_ids], atol=1e-6)
    assert out.top_ids[0].tolist() == [0, 1] and torch.allclose(out.top_logprobs[0], expected[[0, 1]], atol=1e-6)


def _sampled_rows(logits: torch.Tensor, params: list[SamplingParams]) -> SampleOutput:
    """The first ``len(params)`` rows of ``logits`` sampled with processed logprobs and their distributions."""
    n = len(params)
    info = SamplingBatchInfo.from_params(
        params, list(range(n)), [0] * n, [[]] * n, logits.shape[1], torch.device("cpu"), processed_logprobs=True
    )
    info.return_probs = True
    return sample(logits[:n].clone(), info)


def test_processed_logprobs_and_distributions_do_not_depend_on_the_batch() -> None:
    """A row's processed logprobs and drawn-from distribution are the same bits alone and beside rows that use top-p
    (which masked its tail too) or not (a sum over the vocabulary is split over threads differently for one row than
    for several); they are its softmax over the full vocabulary, computed here in float64 (helper 62)."""
    params = [SamplingParams(temperature=0.8, logprobs=True, top_logprobs=2), SamplingParams(top_p=0.9)]
    params += [SamplingParams()] * 2
    for seed in range(6):
        torch.manual_seed(seed)
        logits = torch.randn(len(params), 49152) * 4
        alone, together = _sampled_rows(logits, params[:1]), _sampled_rows(logits, params)
        assert alone.next_token_ids[0] == together.next_token_ids[0]
        assert alone.logprobs is not None and together.logprobs is not None
        assert torch.equal(alone.logprobs[0], together.logprobs[0])
        assert alone.top_logprobs is not None and together.top_logprobs is not None
        assert torch.equal(alone.top_logprobs[0], together.top_logprobs[0])
        assert alone.probs is not None and together.probs is not None
        assert torch.equal(alone.probs[0], together.probs[0])
        exact = torch.log_softmax(logits[0].double() / 0.8, dim=-1)
        # PyTorch's float32 log_softmax: each lane of its vectorized sum adds 49,152 / 8 terms in turn on AVX2 (half
        # as many on AVX-512), an error of order sqrt(6144) u = 5e-6 (u = 2^-24); up to 1.1e-5 seen on an AMD Zen 1.
        assert abs(alone.logprobs[0].item() - exact[alone.next_token_ids[0]].item()) < 5e-5


def test_processed_logprobs_of_top_k_1_are_its_one_token() -> None:
    """top_k 1 at a nonzero temperature draws from a distribution of one token (the argmax): its processed logprob is
    log 1 = 0 and no other token has a probability (vLLM takes processed logprobs after top-k); at temperature 0 the
    row is greedy and reports the log_softmax of its logits."""
    params = [SamplingParams(temperature=0.5, top_k=1, top_logprobs=3), SamplingParams(temperature=0, top_logprobs=3)]
    info = SamplingBatchInfo.from_params(
        params, [1, 2], [0, 0], [[]] * 2, VOCAB, torch.device("cpu"), processed_logprobs=True
    )
    out = sample(LOGITS.expand(2, VOCAB).clone(), info)
    assert out.next_token_ids.tolist() == [0, 0]
    assert out.logprobs[0].item() == 0.0 and out.top_ids[0, 0].item() == 0
    assert out.top_logprobs[0].tolist() == [0.0, -math.inf, -math.inf]
    expected = torch.log_softmax(LOGITS, dim=-1)
    assert torch.allclose(out.top_logprobs[1], expected[[0, 1, 11]], atol=1e-6)


@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_raw_top_logprobs_rank_by_logit_then_id(cpu_kernel: bool) -> None:
    """Raw top lists against numpy: ids by descending logit, equal logits by ascending id (bfloat16-rounded logits
    hold exact ties), values log_softmax of the unprocessed logits in float64; a grammar-masked or biased token keeps
    its raw value, and a row that asks for fewer still gets the batch's k."""
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 300, generator=generator) * 3).bfloat16().float()
    logits[0, [5, 9, 200]] = logits[0].max() + 1.0  # a three-way tie at the top
    logits[2, :] = 0.0  # every token tied
    params = [
        SamplingParams(temperature=0.0, top_logprobs=4, logit_bias=((9, -100.0),)),
        SamplingParams(top_logprobs=1),
        SamplingParams(temperature=0.0, top_logprobs=4),
    ]
    info = SamplingBatchInfo.from_params(params, [0, 1, 2], [0, 0, 0], [[]] * 3, 300, torch.device("cpu"))
    out = sample(logits.clone(), info, cpu_kernel)
    values = logits.double().numpy()
    expected_lp = values - values.max(1, keepdims=True)
    expected_lp -= np.log(np.exp(expected_lp).sum(1, keepdims=True))
    for row in range(3):
        order = sorted(range(300), key=lambda i: (-values[row, i], i))[:4]
        assert out.top_ids[row].tolist() == order
        assert np.allclose(out.top_logprobs[row].numpy(), expected_lp[row, order], atol=1e-5)
        chosen = int(out.next_token_ids[row])
        assert abs(float(out.logprobs[row]) - expected_lp[row, chosen]) < 1e-5
    assert out.top_ids[0].tolist()[:3] == [5, 9, 200] and int(out.next_token_ids[0]) == 5  # bias moves the draw only
    assert out.top_ids[2].tolist() == [0, 1, 2, 3] and int(out.next_token_ids[2]) == 0


# --- end to end on stories260k: cases B19, B24, B25, B26 ------------------------------------------------------

PARK = "Lily and Ben went to the park."


@needs_shared
def test_b24_repetition_penalty_equals_hf(tmp_path: Path) -> None:
    rows = [{"id": "rp", "prompt": PARK, "repetition_penalty": 1.3, "max_new_tokens": 24, "temperature": 0}]
    got = generate(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", STORIES)["rp"]
    expected = [
        342,
        394,
        261,
        370,
        268,
        414,
        444,
        335,
        278,
        309,
        419,
        373,
        280,
        347,
        421,
        285,
        419,
        353,
        312,
        426,
        291,
        262,
        379,
        286,
    ]
    assert got["output_token_ids"] == expected
    assert got["text"] == " They saw a big box with lots of coolers on it. The sun was"
    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
    ids = torch.tensor([tokenizer(PARK)["input_ids"]])
    hf = model.generate(ids, max_new_tokens=24, do_sample=False, repetition_penalty=1.3)
    assert hf[0, ids.shape[1] :].tolist() == expected


def _penalised_reference(prompt_ids: list[int], frequency: float, presence: float, steps: int) -> list[int]:
    """Greedy decoding with OpenAI/vLLM penalties over generated tokens, by hand on HF's forward."""
    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
    ids = list(prompt_ids)
    counts: Counter[int] = Counter()
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].clone()
        for token, count in counts.items():
            logits[token] -= frequency * count + presence
        token = int(logits.argmax())
        counts[token] += 1
        ids.append(token)
    return ids[len(prompt_ids) :]


@needs_shared
def test_b25_frequency_presence_penalties_and_batch_isolation(tmp_path: Path) -> None:
    rows = [
        {"id": "fp", "prompt": PARK, "frequency_penalty": 1.0, "max_new_tokens": 32, "temperature": 0},
        {"id": "pp", "prompt": PARK, "presence_penalty": 1.0, "max_new_tokens": 32, "temperature": 0},
        {"id": "none", "prompt": PARK, "max_new_tokens": 32, "temperature": 0},
    ]
    together = generate(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", STORIES)
    fp = [
        342,
        394,
        261,
        370,
        268,
        414,
        444,
        335,
        261,
        262,
        415,
        271,
        422,
        280,
        412,
        354,
        426,
        291,
        280,
        412,
        354,
        286,
        399,
        282,
        276,
        413,
        413,
        422,
        269,
        381,
        284,
        303,
    ]
    assert together["fp"]["output_token_ids"] == fp
    assert together["fp"]["text"] == " They saw a big box with a shiny cake. The cake was very pretty and had man"
    assert together["pp"]["output_token_ids"] == fp[:-2] + [261, 278]
    prompt_ids = AutoTokenizer.from_pretrained(STORIES)(PARK)["input_ids"]
    assert _penalised_reference(prompt_ids, 1.0, 0.0, 32) == fp
    assert _penalised_reference(prompt_ids, 0.0, 1.0, 32) == fp[:-2] + [261, 278]
    assert together["none"]["output_token_ids"] == _penalised_reference(prompt_ids, 0.0, 0.0, 32)
    for row in rows:
        alone = generate(write_jsonl(tmp_path / f"{row['id']}.jsonl", [row]), tmp_path / f"{row['id']}.arrow", STORIES)
        assert alone[row["id"]]["output_token_ids"] == together[row["id"]]["output_token_ids"]


@needs_shared
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_b26_tiny_temperatures_behave_as_greedy(dtype: str, tmp_path: Path) -> None:
    rows = [
        {"id": "t1e-6", "prompt": "Once upon a time", "temperature": 1e-6, "seed": 0, "max_new_tokens": 16},
        {"id": "t1e-40", "prompt": "Once upon a time", "temperature": 1e-40, "seed": 0, "max_new_tokens": 16},
        {"id": "t0", "prompt": "Once upon a time", "temperature": 0, "max_new_tokens": 16},
        {"id": "tneg", "prompt": "Once upon a time", "temperature": -0.5, "max_new_tokens": 4},
        {"id": "after", "prompt": "The sun was hot.", "temperature": 0, "max_new_tokens": 8},
    ]
    dataset = write_jsonl(tmp_path / "p.jsonl", rows)
    code, output = run_cli(run_args(dataset, tmp_path / "o.arrow", STORIES, "--dtype", dtype, "--no-progress"))
    assert code == 3 and "p.jsonl:4: field 'temperature'" in output
    from tests.helpers.cli import read_rows

    got = read_rows(tmp_path / "o.arrow")
    assert got["t1e-6"]["output_token_ids"] == got["t0"]["output_token_ids"] == got["t1e-40"]["output_token_ids"]
    assert all(np.isfinite(got["t1e-6"]["output_logprobs"]))
    if dtype == "float32":
        assert got["t0"]["output_token_ids"] == [
            432,
            383,
            286,
            261,
            376,
            298,
            315,
            421,
            395,
            317,
            426,
            338,
            401,
            396,
            267,
            337,
        ]
    assert "tneg" not in got and got["after"]["completion_tokens"] == 8


@needs_shared
def test_b19_seeded_row_is_reproducible_in_any_company(tmp_path: Path) -> None:
    seeded = {
        "id": "seeded",
        "prompt": "Once upon a time",
        "temperature": 0.8,
        "seed": 42,
        "max_new_tokens": 16,
        "ignore_eos": True,
    }
    unseeded = {
        "id": "unseeded",
        "prompt": "Once upon a time",
        "temperature": 0.8,
        "max_new_tokens": 16,
        "ignore_eos": True,
    }
    others = [
        {"id": f"o{i}", "prompt": "The sun was hot." * (1 + i % 3), "temperature": 1.0, "max_new_tokens": 10 + i}
        for i in range(30)
    ]
    negative = dict(seeded, id="negative", seed=-42)  # vLLM takes any int64 seed
    runs = [
        ([seeded, unseeded, negative], []),
        ([unseeded, seeded], []),
        ([seeded], []),
        ([*others[:15], seeded, *others[15:], negative], ["--max-running-requests", "8"]),
        ([dict(seeded, id="twin"), seeded], []),
    ]
    results, negatives = [], []
    for k, (rows, flags) in enumerate(runs):
        out = generate(write_jsonl(tmp_path / f"{k}.jsonl", rows), tmp_path / f"{k}.arrow", STORIES, *flags)
        results.append(out["seeded"]["output_token_ids"])
        negatives += [out["negative"]["output_token_ids"]] if "negative" in out else []
        if "twin" in out:
            assert out["twin"]["output_token_ids"] == out["seeded"]["output_token_ids"]
    assert all(r == results[0] for r in results) and len(results[0]) == 16
    assert negatives[0] == negatives[1] != results[0]


# --- findings of an adversarial review ------------------------------------------------------------------------


def test_seeded_row_ignores_other_rows_truncation() -> None:
    """A row's draw must not depend on whether another row of the batch uses top_p (which sorts)."""
    plain = SamplingParams(temperature=1.0)
    nucleus = SamplingParams(temperature=1.0, top_p=0.9)
    for seed in range(50):
        alone = sample(
            LOGITS[None].clone(), SamplingBatchInfo.from_params([plain], [seed], [0], [[]], VOCAB, torch.device("cpu"))
        ).next_token_ids[0]
        mixed = sample(
            LOGITS.expand(2, VOCAB).clone(),
            SamplingBatchInfo.from_params([plain, nucleus], [seed, 99], [0, 0], [[]] * 2, VOCAB, torch.device("cpu")),
        ).next_token_ids[0]
        assert alone == mixed, seed


def test_ban_that_would_leave_nothing_is_lifted() -> None:
    """min_new_tokens bans EOS while a grammar allows only EOS: the row still gets a real token."""
    from batchgen.sampling.grammar import pack_bits

    only_eos = torch.zeros(VOCAB, dtype=torch.bool)
    only_eos[2] = True
    for temperature in (0.0, 1.0):
        info = SamplingBatchInfo.from_params(
            [SamplingParams(temperature=temperature)], [0], [0], [[2]], VOCAB, torch.device("cpu")
        )
        info.grammar_mask = pack_bits(only_eos)[None]
        assert sample(LOGITS[None].clone(), info).next_token_ids.tolist() == [2]


def test_values_that_overflow_float32_are_rejected(random_models: dict[str, Path], tmp_path: Path) -> None:
    rows = [
        {"prompt": "x", "temperature": 1e39},
        {"prompt": "x", "repetition_penalty": 1e-50},
        {"id": "ok", "prompt": "x", "prompt_logprobs": None},
    ]
    code, output = run_cli(
        run_args(
            write_jsonl(tmp_path / "p.jsonl", rows),
            tmp_path / "o.arrow",
            random_models["llama"],
            "--max-new-tokens",
            "2",
        )
    )
    assert code == 3
    assert "p.jsonl:1: field 'temperature': must be a number in [0, 10000]" in output
    assert "p.jsonl:2: field 'repetition_penalty': must be in [0.01, 100]" in output
    assert "p.jsonl:3" not in output  # null means "the default", as for every sampling field


def test_prompt_logprobs_without_generation(random_models: dict[str, Path], tmp_path: Path) -> None:
    rows = [{"id": "score", "prompt_token_ids": [0, 5, 9, 14, 20], "max_new_tokens": 0, "prompt_logprobs": 1}]
    out = generate(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", random_models["llama"])["score"]
    assert out["output_token_ids"] == [] and out["finish_reason"] == "length" and out["text"] == ""
    assert len(out["prompt_logprobs"]) == 4 and len(out["prompt_top_logprobs"]) == 4


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({"300": 100, "0300": 100}, "token id 300 is given twice"),
        ({"٣٠٠": 1}, "key '٣٠٠' is not a token id"),
        ({"-1": 1}, "key '-1' is not a token id"),
        ({"5": 101}, "bias of id 5 must be in [-100, 100]"),
    ],
)
def test_bad_logit_bias(bias: dict[str, float], message: str) -> None:
    from batchgen.errors import FieldError
    from batchgen.sampling.row_fields import make_sampling_params

    with pytest.raises(FieldError, match="logit_bias") as raised:
        make_sampling_params(SamplingParams(), {"logit_bias": bias}, vocab_size=512)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("allowed", "message"),
    [([], "must not be empty"), ([3, 512], "id 512 is outside the vocabulary [0, 512)"), ("3", "list of integers")],
)
def test_bad_allowed_token_ids(allowed: object, message: str) -> None:
    from batchgen.errors import FieldError
    from batchgen.sampling.row_fields import make_sampling_params

    with pytest.raises(FieldError, match="allowed_token_ids") as raised:
        make_sampling_params(SamplingParams(), {"allowed_token_ids": allowed}, vocab_size=512)
    assert message in str(raised.value)


def test_counter_uniforms_are_uniform_for_every_seed_and_step() -> None:
    """Kolmogorov–Smirnov against U(0, 1) across seeds at step 0 and across steps of seed 0; seed 0 at step 0
    once drew u ≈ 1e-10 (the hash's fixed point at 0), so every seed-0 row began with an unlikely token."""
    from scipy.stats import kstest

    from batchgen.sampling.random import uniform_from_counter

    ids = torch.arange(4096, dtype=torch.int64)
    zero = torch.zeros(4096, dtype=torch.int64)
    for seeds, steps in ((ids, zero), (zero, ids), (ids + 2**40, ids)):
        u = uniform_from_counter(seeds, steps).numpy()
        assert kstest(u, "uniform").pvalue > 1e-3
    assert 1e-3 < float(uniform_from_counter(zero[:1], zero[:1])) < 1 - 1e-3


def test_whole_floats_are_integers_where_a_field_takes_one() -> None:
    """pandas writes an integer column with nulls as float64 (4.0): integer sampling fields take such floats as
    the integers they are; a fraction stays an error (tests/e2e/test_bad_input.py)."""
    from batchgen.sampling.row_fields import make_sampling_params

    overrides = {"max_new_tokens": 4.0, "top_k": 3.0, "seed": 2.0, "stop_token_ids": [5.0, 7], "n": 2.0}
    params = make_sampling_params(SamplingParams(), overrides, vocab_size=512)
    values = (params.max_new_tokens, params.top_k, params.seed, params.stop_token_ids, params.n)
    assert values == (4, 3, 2, (5, 7), 2)
    assert all(type(v) is int for v in (*values[:3], *values[3], values[4]))
    assert make_sampling_params(SamplingParams(), {"prompt_logprobs": 2.0}, vocab_size=512).prompt_logprobs == 2
