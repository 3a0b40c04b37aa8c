"""Speculative decoding (n-gram drafts, TARGET_VERIFY rounds): exact under greedy and sampling."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchgen.loop.drafter import accepted_length
from batchgen.loop.engine import Engine
from batchgen.loop.options import EngineOptions
from batchgen.loop.req import Req
from batchgen.sampling.sampling_params import SamplingParams
from batchgen.speculative import make_drafter
from batchgen.speculative.ngram import NgramIndex
from batchgen.speculative.verify import PerRequestDrafter, plan_drafts
from tests.helpers.cli import generate, read_rows, run_args, run_cli, write_jsonl
from tests.helpers.engine import (
    FIRST_TOKENS_PROMPT,
    assert_first_two_tokens_follow_top5,
    sample_first_tokens,
    spy_graph_runs,
)

# Tests here count accepted drafts: the timed draft budget must not hold any back (see the fixture).
pytestmark = pytest.mark.usefixtures("every_draft_verified")

SPEC = ("--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "4", "--speculative-ngram-min", "1")


def test_ngram_index_proposes_what_followed_the_latest_longest_match() -> None:
    index = NgramIndex(1, 3)
    #        0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 6]
    assert index.propose(tokens, 3) == [7, 1, 6]  # suffix [6]: latest earlier 6 is at 5, followed by 7 1 6
    tokens += [7]  # suffix [6, 7] matched at 5..6 (latest), followed by 1 6 7
    assert index.propose(tokens, 2) == [1, 6]
    assert index.propose([*tokens, 42], 4) == []  # 42 never occurred before
    assert NgramIndex(2, 3).propose([1, 2, 3], 2) == []  # no 2-gram repeats


@pytest.mark.parametrize(
    ("targets", "drafts", "emit"),
    [([4], [], 1), ([4, 5], [9], 1), ([4, 5], [4], 2), ([4, 5, 6, 7], [4, 5, 6], 4), ([4, 5, 6, 7], [4, 9, 6], 2)],
)
def test_accepted_length(targets: list[int], drafts: list[int], emit: int) -> None:
    assert accepted_length(targets, drafts) == emit


def _repetitive_rows(count: int, greedy: bool) -> list[dict[str, Any]]:
    rng = random.Random(7)
    rows = []
    for i in range(count):
        motif = [rng.randrange(2, 300) for _ in range(rng.randrange(2, 6))]
        rows.append(
            {
                "id": str(i),
                "prompt_token_ids": [0] + motif * rng.randrange(2, 6) + motif[: rng.randrange(len(motif))],
                "max_new_tokens": rng.randrange(1, 40),
                "temperature": 0 if greedy else 0.3,
                "seed": i,
                "top_logprobs": 2,
                "ignore_eos": i % 3 != 0,  # every third row may end at EOS inside an accepted run
            }
        )
    return rows


@pytest.mark.parametrize("max_running", ["1", "8"])
@pytest.mark.parametrize("greedy", [True, False])
def test_outputs_equal_plain_decoding(
    max_running: str, greedy: bool, random_models: dict[str, Path], tmp_path: Path
) -> None:
    """Tokens, logprobs and top logprobs are the same with and without n-gram speculation, greedy or seeded,
    with chunked prefill on; runs end inside accepted drafts by max_new_tokens (1..39) and by EOS."""
    dataset = write_jsonl(tmp_path / "in.jsonl", _repetitive_rows(16, greedy))
    common = ("--max-running-requests", max_running, "--chunked-prefill-size", "16")
    model = random_models["llama"]
    plain = generate(dataset, tmp_path / "plain.jsonl", model, *common)
    spec = generate(dataset, tmp_path / "spec.jsonl", model, *common, *SPEC)
    for rid, want in plain.items():
        got = spec[rid]
        assert got["output_token_ids"] == want["output_token_ids"], rid
        assert got["finish_reason"] == want["finish_reason"]
        assert got["output_logprobs"] == pytest.approx(want["output_logprobs"], abs=1e-5)
        assert [[t["id"] for t in s] for s in got["top_logprobs"]] == [
            [t["id"] for t in s] for s in want["top_logprobs"]
        ]
        assert want["spec_accept_length"] is None
    lengths = [r["spec_accept_length"] for r in spec.values() if r["spec_accept_length"] is not None]
    assert max(lengths) > (1.5 if greedy else 1.0)  # drafts were accepted: more than one token per round


def test_stop_strings_and_penalties_inside_accepted_runs(random_models: dict[str, Path], tmp_path: Path) -> None:
    """A stop string completed by an accepted draft ends the row there, as without speculation; penalties see
    each verified position's tentative history."""
    model = random_models["llama"]
    plain_rows = generate(write_jsonl(tmp_path / "a.jsonl", _repetitive_rows(8, True)), tmp_path / "a_out.jsonl", model)
    rows = []
    for row in _repetitive_rows(8, True):
        text = plain_rows[row["id"]]["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 2] if len(text) > 4 else None
        rows.append({**row, "stop": [stop] if stop else [], "ignore_eos": True, "max_new_tokens": 40})
        rows.append({**row, "id": row["id"] + "p", "repetition_penalty": 1.2, "frequency_penalty": 0.3})
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    plain = generate(dataset, tmp_path / "plain.jsonl", model)
    spec = generate(dataset, tmp_path / "spec.jsonl", model, *SPEC)
    assert any(r["matched_stop"] is not None and r["finish_reason"] == "stop" for r in spec.values())
    for rid, want in plain.items():
        got = spec[rid]
        assert (got["output_token_ids"], got["text"], got["matched_stop"]) == (
            want["output_token_ids"],
            want["text"],
            want["matched_stop"],
        ), rid


class _TableDrafter(PerRequestDrafter):
    """Test drafter: proposes ``table[last output token]`` (the likely continuation, then a wrong token)."""

    num_draft_tokens = 2

    def __init__(self, table: dict[int, list[int]]) -> None:
        self.table = table

    def propose(self, req: Req, limit: int) -> list[int]:
        return self.table.get(req.output_ids[-1], [])[:limit] if req.output_ids else []


def test_sampled_first_two_tokens_follow_the_exact_distribution(random_models: dict[str, Path], tmp_path: Path) -> None:
    """2,000 seeded samples (top_k 5, temperature 1) of the first two tokens, with and without speculation,
    against the exact joint distribution computed from HF transformers; the drafter proposes the most likely
    second token (often accepted) and then a wrong one, so acceptance and rejection both happen."""
    model_dir = random_models["mistral"]
    prompt = FIRST_TOKENS_PROMPT
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        first = hf(torch.tensor([prompt])).logits[0, -1].topk(5).indices.tolist()
        table = {t0: [int(hf(torch.tensor([[*prompt, t0]])).logits[0, -1].argmax()), 3] for t0 in first}

    for speculative in (False, True):
        engine = Engine(
            EngineOptions(
                model=str(model_dir),
                dtype="float32",
                device="cpu",
                max_running_requests=256,
                speculative_algorithm="ngram" if speculative else None,
            ),
            make_drafter,
        )
        if speculative:
            engine.scheduler.drafter = _TableDrafter(table)
        finished = sample_first_tokens(engine, tmp_path / "p.jsonl", max_new_tokens=4)
        if speculative:
            assert {1, 2} <= set(engine.scheduler.accept_histogram)  # drafts rejected and accepted
        assert_first_two_tokens_follow_top5(model_dir, prompt, finished)


def test_bad_speculative_options_are_one_line_errors(random_models: dict[str, Path], tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    for extra, message in [
        (("--speculative-algorithm", "magic"), "--speculative-algorithm must be one of ngram, draft, got 'magic'"),
        # Checked with speculation off too: a bad value is a mistake whether or not it is used.
        (("--speculative-num-draft-tokens", "0"), "--speculative-num-draft-tokens must be >= 1, got 0"),
        (
            ("--speculative-acceptance", "bogus"),
            "--speculative-acceptance must be one of rejection, coupled, got 'bogus'",
        ),
        (("--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "0"), "must be >= 1, got 0"),
        (
            ("--speculative-algorithm", "ngram", "--speculative-ngram-min", "3", "--speculative-ngram-max", "2"),
            "1 <= min <= max, got 3 and 2",
        ),
    ]:
        code, output = run_cli(run_args(dataset, tmp_path / "o.jsonl", random_models["llama"], *extra))
        assert code == 2 and message in output and "Traceback" not in output
    assert not (tmp_path / "o.jsonl").exists() or read_rows(tmp_path / "o.jsonl") == {}


@pytest.mark.parametrize(("max_running", "greedy"), [("1", True), ("8", True), ("8", False)])
def test_verify_rounds_through_the_graph_runner(
    max_running: str, greedy: bool, random_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the graph runner on (eager-padded on CPU, as on GPU without capture), every request verifies exactly
    K drafts, TARGET_VERIFY rounds are served padded to a captured batch size, and outputs equal plain decoding."""
    served = spy_graph_runs(monkeypatch)  # (mode, batch size, padded size) per round
    dataset = write_jsonl(tmp_path / "in.jsonl", _repetitive_rows(12, greedy))
    common = ("--max-running-requests", max_running, "--chunked-prefill-size", "16")
    model = random_models["llama"]
    plain = generate(dataset, tmp_path / "plain.jsonl", model, *common)
    assert not served
    spec = generate(dataset, tmp_path / "spec.jsonl", model, *common, *SPEC, "--cuda-graph-max-bs", "8")
    for rid, want in plain.items():
        got = spec[rid]
        assert (got["output_token_ids"], got["finish_reason"]) == (want["output_token_ids"], want["finish_reason"]), rid
        assert got["output_logprobs"] == pytest.approx(want["output_logprobs"], abs=1e-5)
    verify = [key for key in served if key[0] == "TARGET_VERIFY"]
    assert verify, served
    if max_running == "8":
        assert any(bs < padded for _, bs, padded in verify)  # some rounds carried padding rows


class _ShortDrafter(PerRequestDrafter):
    """Proposes ``[7]`` (one token, fewer than asked) for every request."""

    num_draft_tokens = 4

    def propose(self, req: Req, limit: int) -> list[int]:
        return [7]


class _EvenTokens:
    """A stand-in grammar state: accepts even tokens only, and terminates after accepting 100."""

    def __init__(self, accepted: tuple[int, ...] = ()) -> None:
        self.accepted = accepted
        self.terminated = bool(accepted) and accepted[-1] == 100

    def fork(self) -> _EvenTokens:
        return _EvenTokens(self.accepted)

    def accept(self, token_id: int, may_end: bool = True) -> bool:
        if token_id % 2:
            return False
        self.accepted += (token_id,)
        self.terminated = token_id == 100
        return True


def _decoding_req(output_ids: list[int], grammar: Any = None, max_new_tokens: int = 50, max_total_len: int = 64) -> Req:
    params = SamplingParams(max_new_tokens=max_new_tokens)
    req = Req("r", [1, 2, 3], params, 0, frozenset(), max_total_len=max_total_len)
    req.output_ids, req.kv_len, req.grammar = list(output_ids), 3 + len(output_ids) - 1, grammar
    return req


def test_padded_drafts_fill_to_the_limit_and_keep_grammar_states() -> None:
    """pad=True: a request gets K drafts, the proposal then copies of its last token (or of the pending token),
    also past max_new_tokens (those draws are never emitted) but not past the context length or the KV room;
    grammar states follow the drafts, and after a draft the grammar rejects (or one that ends it) positions are
    unconstrained, since they are never reached. Without pad the list stops there."""
    drafter = _ShortDrafter()
    plain, padded, near_max = _decoding_req([5]), _decoding_req([5]), _decoding_req([5], max_new_tokens=3)
    near_context = _decoding_req([5], max_total_len=6)  # prompt 3 + output 1: two positions left
    assert [d.ids for d in plan_drafts([plain], drafter, room=100)] == [[7]]
    padded_drafts = plan_drafts([padded, near_max, near_context], drafter, room=100, pad=True)
    assert [d.ids for d in padded_drafts] == [[7, 7, 7, 7], [7, 7, 7, 7], [7, 7]]
    assert [d.ids for d in plan_drafts([near_max], drafter, room=100)] == [[7]]  # without pad: then max_new_tokens
    assert [len(d.ids) for d in plan_drafts([padded, plain], drafter, room=6, pad=True)] == [4, 2]  # KV room runs out

    class Proposes(PerRequestDrafter):
        num_draft_tokens = 4

        def __init__(self, tokens: list[int]) -> None:
            self.tokens = tokens

        def propose(self, req: Req, limit: int) -> list[int]:
            return self.tokens

    for tokens, pad, want_ids, want_states in [
        ([2, 4], True, [2, 4, 4, 4], [(), (2,), (2, 4), (2, 4, 4), (2, 4, 4, 4)]),
        ([2, 3, 4], True, [2, 3, 4, 4], [(), (2,), None, None, None]),  # 3 rejected: kept, later unconstrained
        ([2, 3, 4], False, [2], [(), (2,)]),  # without pad: cut before the rejected draft
        ([2, 100, 4], True, [2, 100, 4, 4], [(), (2,), None, None, None]),  # 100 ends the grammar
        ([2, 100, 4], False, [2, 100], [(), (2,), None]),
        ([], True, [6, 6, 6, 6], [(), (6,), (6, 6), (6, 6, 6), (6, 6, 6, 6)]),  # copies of the pending token 6
    ]:
        req = _decoding_req([6], grammar=_EvenTokens())
        (drafts,) = plan_drafts([req], Proposes(tokens), room=100, pad=pad)
        assert drafts.ids == want_ids, tokens
        assert [None if g is None else g.accepted for g in drafts.grammars] == want_states, tokens  # type: ignore[attr-defined]
