"""Speculative decoding with a draft model: exact outputs, full acceptance when draft = target, KV accounting."""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

from batchgen.loop.engine import Engine
from batchgen.loop.forward_mode import ForwardMode
from batchgen.loop.options import EngineOptions
from batchgen.loop.req import Req
from batchgen.speculative import make_drafter
from batchgen.speculative.draft_model import DraftModelDrafter
from tests.helpers.cli import generate, run_args, run_cli, write_jsonl
from tests.helpers.engine import (
    FIRST_TOKENS_PROMPT,
    UNMATCHED_STOP,
    assert_first_two_tokens_follow_top5,
    enqueue_rows,
    spy_graph_runs,
)
from tests.helpers.models import build_random_model, perturbed_copy

# Tests here count accepted drafts: the timed draft budget must not hold any back (see the fixture).
pytestmark = pytest.mark.usefixtures("every_draft_verified")

K = 4
# Sampled rows give plain decoding's outputs only with coupled acceptance (rejection sampling redraws rejections).
COUPLED = {"speculative_acceptance": "coupled"}


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A different, smaller (1 layer) random llama with the test tokenizer, so the target's vocabulary."""
    return build_random_model(tmp_path_factory.mktemp("draft") / "llama1", "llama", seed=1, num_hidden_layers=1)


@pytest.fixture(scope="module")
def perturbed_draft(random_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target with a little noise on its weights: it agrees with the target often but not always, so drafts
    are accepted partly (some rounds keep 1..K - 1 drafts)."""
    return perturbed_copy(random_models["llama"], tmp_path_factory.mktemp("draft") / "perturbed")


def _rows(count: int, sampled: bool) -> list[dict[str, Any]]:
    """Prompts of 8..40 tokens (longer than the 16-token prefill chunks); max_new_tokens = 1 + 5m, so with K = 4
    every verify round has room for K drafts and emits K + 1 tokens when they are all accepted."""
    rng = random.Random(3)
    rows = []
    for i in range(count):
        row: dict[str, Any] = {
            "id": str(i),
            "prompt_token_ids": [0] + [rng.randrange(2, 300) for _ in range(rng.randrange(8, 40))],
            "max_new_tokens": 1 + (K + 1) * rng.randrange(1, 5),
            "temperature": 0.8 if sampled else 0,
            "seed": 100 + i,
            "top_logprobs": 2,
            "ignore_eos": True,
        }
        if sampled:  # every sampling input the coupled draft must reproduce
            row.update([{}, {"top_p": 0.9}, {"min_p": 0.05, "top_k": 20}, {"repetition_penalty": 1.3}][i % 4])
            if i == 1:
                row["n"] = 2  # forked samples draft from their own draft rows
        rows.append(row)
    return rows


@dataclass
class _Run:
    """The finished requests by (id, sample index); per request of each TARGET_VERIFY round, (tokens emitted,
    tokens emitted if all K drafts the limits allow were accepted); how many retractions there were."""

    reqs: dict[tuple[str, int], Req]
    verify_emits: list[tuple[int, int]]
    retracted: int

    def all_accepted(self) -> bool:
        return bool(self.verify_emits) and all(got == full for got, full in self.verify_emits)

    def partly_accepted(self) -> bool:
        """Some verify round kept some of its drafts but not all (the draft KV rolls back inside a run)."""
        return any(1 < got < full for got, full in self.verify_emits)


def _run(model: Path, rows: list[dict[str, Any]], tmp_path: Path, draft: Path | None = None, **options: Any) -> _Run:
    """Run ``rows`` through an Engine (fp32, CPU, 16-token prefill chunks); check that every slot and row of
    both pools is free after."""
    engine = Engine(
        EngineOptions(
            model=str(model),
            dtype="float32",
            device="cpu",
            chunked_prefill_size=16,
            speculative_algorithm="draft" if draft else None,
            speculative_num_draft_tokens=K,
            speculative_draft_model=str(draft) if draft else None,
            **options,
        ),
        make_drafter,
    )
    enqueue_rows(engine, rows, tmp_path / "rows.jsonl", eos=False)
    scheduler = engine.scheduler
    process_result = scheduler.process_result
    verify_emits: list[tuple[int, int]] = []

    def recording_process_result(batch: Any, *args: Any) -> list[Req]:
        before = [len(r.output_ids) for r in batch.reqs]
        # A round emits 1 + K tokens unless max_new_tokens (or the context) is nearer: rows decoding in MIXED
        # rounds take one token there, so their later verify rounds may have room for fewer drafts.
        full = [
            1 + min(K, r.params.max_new_tokens - n - 1, r.max_total_len - r.fill_len)
            for r, n in zip(batch.reqs, before)
        ]
        finished = process_result(batch, *args)
        if batch.forward_mode == ForwardMode.TARGET_VERIFY:
            verify_emits.extend((len(r.output_ids) - n, f) for r, n, f in zip(batch.reqs, before, full))
        return finished

    scheduler.process_result = recording_process_result  # type: ignore[method-assign]
    finished: list[Req] = []
    while engine.has_work():
        finished += engine.step()
    assert engine.kv_cache.available() == engine.kv_cache.size
    assert engine.kv_cache.available_rows() == engine.max_running_requests
    if draft is not None:
        drafter = scheduler.drafter
        assert isinstance(drafter, DraftModelDrafter)
        assert drafter.kv_cache.available() == drafter.kv_cache.size  # rejected drafts' slots freed too
        assert drafter.kv_cache.available_rows() == engine.max_running_requests
        assert all(r.draft_state is None or r.draft_state.proposer is None for r in finished)
    return _Run({(r.rid, r.sample_index): r for r in finished}, verify_emits, scheduler.num_retracted)


def _spec_counts(req: Req) -> tuple[int, int]:
    """The request's verify rounds with proposed drafts and the tokens they emitted."""
    state = req.draft_state
    return (state.rounds, state.tokens) if state is not None else (0, 0)


def _assert_same_outputs(got: dict[tuple[str, int], Req], want: dict[tuple[str, int], Req]) -> None:
    assert got.keys() == want.keys()
    for key, plain in want.items():
        spec = got[key]
        assert spec.output_ids == plain.output_ids, key
        assert spec.finish_reason == plain.finish_reason
        assert spec.output_logprobs == pytest.approx(plain.output_logprobs, abs=1e-5)
        assert [[t for t, _ in top] for top in spec.output_top_logprobs] == [
            [t for t, _ in top] for top in plain.output_top_logprobs
        ]


@pytest.mark.parametrize("max_running", [1, 8])
def test_greedy_outputs_equal_plain_decoding(
    max_running: int, random_models: dict[str, Path], other_draft: Path, tmp_path: Path
) -> None:
    """Greedy fp32: ids and logprobs equal plain decoding with a different draft model and with the target as
    its own draft; the latter has every draft accepted, K + 1 tokens per verify round."""
    model = random_models["llama"]
    rows = _rows(10, sampled=False)
    plain = _run(model, rows, tmp_path, max_running_requests=max_running).reqs
    other = _run(model, rows, tmp_path, draft=other_draft, max_running_requests=max_running)
    _assert_same_outputs(other.reqs, plain)
    itself = _run(model, rows, tmp_path, draft=model, max_running_requests=max_running)
    _assert_same_outputs(itself.reqs, plain)
    assert itself.all_accepted()
    if max_running == 1:  # no MIXED rounds, where decodes take one token: verify rounds carry all K drafts
        assert max(tokens / rounds for rounds, tokens in map(_spec_counts, itself.reqs.values())) == K + 1


def test_graph_runner_pads_verify_rounds_and_keeps_outputs(
    random_models: dict[str, Path], perturbed_draft: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the graph runner on (eager-padded on CPU) for both models, seeded sampling with a partly accepted
    draft gives plain decoding's outputs (coupled acceptance), and the draft = target run still accepts
    everything it drafted."""
    served = spy_graph_runs(monkeypatch)
    model = random_models["llama"]
    rows = _rows(8, sampled=True)
    plain = _run(model, rows, tmp_path, max_running_requests=8, enable_mixed_chunk=False).reqs
    graphs = {"cuda_graph_max_bs": 4, "max_running_requests": 8, "enable_mixed_chunk": False}
    near = _run(model, rows, tmp_path, draft=perturbed_draft, **graphs, **COUPLED)
    _assert_same_outputs(near.reqs, plain)
    assert near.partly_accepted()
    itself = _run(model, rows, tmp_path, draft=model, **graphs, **COUPLED)
    _assert_same_outputs(itself.reqs, plain)
    # Every verify round carries K drafts per request now (padded past max_new_tokens): a full acceptance emits
    # as many tokens as max_new_tokens leaves.
    assert all(got == full for got, full in itself.verify_emits)
    # Padding drafts are not counted: per request, the verify rounds with proposed drafts and the tokens they
    # emitted are those of the run without the graph runner.
    # Here "a" has nothing left to draft after its first token while "b" verifies beside it (a reviewer's case).
    prompt = [0, 5, 6, 7, 5, 6, 7, 5, 6]
    pair = [
        {"id": rid, "prompt_token_ids": prompt, "max_new_tokens": n, "temperature": 0, "ignore_eos": True}
        for rid, n in (("a", 2), ("b", 12))
    ]
    for case in (rows, pair):
        eager = _run(model, case, tmp_path, draft=model, max_running_requests=8, enable_mixed_chunk=False, **COUPLED)
        padded = _run(model, case, tmp_path, draft=model, **graphs, **COUPLED)
        counts = {key: _spec_counts(r) for key, r in eager.reqs.items()}
        assert {key: _spec_counts(r) for key, r in padded.reqs.items()} == counts
    assert counts[("a", 0)] == (0, 0)
    modes = Counter(mode for mode, _, _ in served)
    assert modes["TARGET_VERIFY"] > 0 and modes["DECODE"] > 0  # the draft model's steps are DECODE rounds


def test_coupled_sampled_outputs_equal_plain_decoding_and_identical_draft_is_always_accepted(
    random_models: dict[str, Path], perturbed_draft: Path, tmp_path: Path
) -> None:
    """Coupled acceptance: seeded sampling (temperature 0.8, top-p, top-k, min-p, repetition penalty, n = 2)
    gives plain decoding's outputs with a draft that is partly accepted; and, since the draft model draws with
    the target's uniforms and inputs, with draft = target every draft is accepted."""
    model = random_models["llama"]
    rows = _rows(8, sampled=True)
    plain = _run(model, rows, tmp_path, max_running_requests=8, enable_mixed_chunk=False).reqs
    near = _run(
        model, rows, tmp_path, draft=perturbed_draft, max_running_requests=8, enable_mixed_chunk=False, **COUPLED
    )
    _assert_same_outputs(near.reqs, plain)
    assert near.partly_accepted()
    itself = _run(model, rows, tmp_path, draft=model, max_running_requests=8, enable_mixed_chunk=False, **COUPLED)
    _assert_same_outputs(itself.reqs, plain)
    assert ("1", 1) in itself.reqs  # the n = 2 row's second sample
    assert itself.all_accepted()
    assert {tokens / rounds for rounds, tokens in map(_spec_counts, itself.reqs.values())} == {K + 1}


def test_rejection_sampling_follows_the_exact_distribution_and_accepts_more_than_coupling(
    random_models: dict[str, Path], perturbed_draft: Path, tmp_path: Path
) -> None:
    """Default (rejection) acceptance with a draft model: the first two tokens of 2,000 seeded samples (top_k 5,
    temperature 1; the second decided by a verify round) follow the exact joint distribution computed from HF
    transformers, with drafts both accepted and rejected; and more drafts are accepted than under the coupled
    rule, since rejection sampling accepts with probability Σ min(p, q), the most any rule can."""
    model = random_models["llama"]
    prompt = FIRST_TOKENS_PROMPT
    rows = [
        {"id": str(k), "prompt_token_ids": prompt, "n": 250, "seed": k, "top_k": 5, "max_new_tokens": 3}
        for k in range(8)
    ]
    accepted = {}
    for name, options in [
        ("rejection", {}),
        ("rejection, graph runner", {"cuda_graph_max_bs": 256}),  # padding drafts verify with a one-hot q
        ("coupled", {"speculative_acceptance": "coupled"}),
    ]:
        run = _run(model, rows, tmp_path, draft=perturbed_draft, max_running_requests=256, **options)
        reqs = list(run.reqs.values())
        assert len(reqs) == 2000
        emitted = Counter(got for got, _ in run.verify_emits)
        assert emitted[1] > 0 and emitted[2] > 0, name  # drafts rejected and accepted
        accepted[name] = emitted[2] / len(run.verify_emits)
        if name != "coupled":
            assert_first_two_tokens_follow_top5(model, prompt, reqs)
    assert accepted["rejection"] > accepted["coupled"] + 0.1, accepted


def test_retraction_frees_draft_rows_and_keeps_outputs(
    random_models: dict[str, Path], perturbed_draft: Path, tmp_path: Path
) -> None:
    """A KV pool so small that requests are retracted: they give back their draft rows and KV, catch up from
    scratch later, and the outputs stay those of plain decoding. The rows' stop string makes the scheduler estimate
    their growth, and over-admit."""
    model = random_models["llama"]
    rows = [row | {"stop": [UNMATCHED_STOP]} for row in _rows(10, sampled=False)]
    plain = _run(model, rows, tmp_path, max_running_requests=8).reqs
    # Whether a pool size retracts depends on the order of admission (the prefix cache's, or first come, first
    # served without it): each draft runs with a few small pools, every run must equal plain decoding, and some
    # run of each draft must have retracted.
    for draft in (model, perturbed_draft):
        retracted = 0
        for pool, cache in ((80, True), (90, True), (100, True), (80, False)):
            small = _run(
                model, rows, tmp_path, draft=draft, max_running_requests=8, max_total_tokens=pool, prefix_cache=cache
            )
            _assert_same_outputs(small.reqs, plain)
            retracted += small.retracted
        assert retracted > 0


def test_cli_draft_model_with_text_stops_and_grammar(
    random_models: dict[str, Path], other_draft: Path, tmp_path: Path
) -> None:
    """``batchgen run --speculative-draft-model``: rows with a stop string, EOS, a regex constraint and
    sampling come out as without speculation (sampled rows with ``--speculative-acceptance coupled``; with the
    default rejection sampling greedy rows do, and the regex still holds). The draft follows the regex to its
    end, so a verify round holds a draft that terminates the grammar (the position after it samples
    unconstrained; its draw is never used)."""
    model = random_models["llama"]
    rows = [
        {"id": "greedy", "prompt": "Once upon a time", "max_new_tokens": 30, "temperature": 0},
        {"id": "stop", "prompt": "The quick brown fox", "max_new_tokens": 30, "temperature": 0, "stop": ["e"]},
        {"id": "sampled", "prompt": "Numbers like", "max_new_tokens": 30, "temperature": 1.0, "seed": 5},
        {"id": "regex", "prompt": "Code:", "regex": r"[a-c]{2,4}-\d{3}", "temperature": 1.0, "seed": 2},
    ]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    plain = generate(dataset, tmp_path / "plain.jsonl", model)
    for draft, acceptance in [(other_draft, "coupled"), (model, "coupled"), (other_draft, "rejection")]:
        spec = generate(
            dataset,
            tmp_path / "spec.jsonl",
            model,
            *("--speculative-algorithm", "draft", "--speculative-draft-model", str(draft)),
            *("--speculative-acceptance", acceptance),
        )
        for rid, want in plain.items():
            if acceptance == "rejection" and rid in ("sampled", "regex"):
                continue
            got = spec[rid]
            assert (got["output_token_ids"], got["text"], got["finish_reason"]) == (
                want["output_token_ids"],
                want["text"],
                want["finish_reason"],
            ), (rid, draft)
        assert re.fullmatch(r"[a-c]{2,4}-\d{3}", spec["regex"]["text"])
        assert spec["sampled"]["finish_reason"] in ("stop", "length")


def test_bad_draft_options_are_one_line_errors(random_models: dict[str, Path], tmp_path: Path) -> None:
    wide = build_random_model(tmp_path / "wide", "llama", seed=2, vocab_size=512)
    target_vocab = AutoConfig.from_pretrained(random_models["llama"]).vocab_size
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    for extra, message in [
        (
            ("--speculative-algorithm", "draft", "--speculative-draft-model", str(wide)),
            f"vocabulary of 512 tokens, the target model's has {target_vocab}",
        ),
        (("--speculative-algorithm", "draft"), "--speculative-algorithm draft needs --speculative-draft-model"),
        (
            (
                "--speculative-algorithm",
                "draft",
                "--speculative-draft-model",
                str(wide),
                "--speculative-acceptance",
                "x",
            ),
            "--speculative-acceptance must be one of rejection, coupled, got 'x'",
        ),
        (("--speculative-draft-model", str(wide)), "--speculative-draft-model needs --speculative-algorithm draft"),
        (
            ("--speculative-algorithm", "draft", "--speculative-draft-model", str(tmp_path / "nowhere")),
            f"--speculative-draft-model {tmp_path / 'nowhere'}: ",
        ),
    ]:
        code, output = run_cli(run_args(dataset, tmp_path / "o.jsonl", random_models["llama"], *extra))
        errors = [line for line in output.splitlines() if line.startswith("batchgen: error:")]
        assert code == 2 and "Traceback" not in output, output
        assert len(errors) == 1 and message in errors[0], output
    assert not (tmp_path / "o.jsonl").exists()
