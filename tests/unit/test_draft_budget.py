"""The draft budget: the round cost fit, per-position acceptance records, and how many drafts they allow."""

from __future__ import annotations

import pytest

from batchgen.loop.round_cost import MIN_ROUNDS, PROBE_EVERY, RoundCostModel
from batchgen.speculative.draft_budget import drafts_worth_verifying, fade_held_back, record_acceptance
from batchgen.speculative.draft_state import DraftState


def test_cost_model_recovers_a_linear_round_time() -> None:
    model = RoundCostModel()
    # Rounds of 64 to 320 tokens costing 10 ms + 1 ms per token (hand-made, exact).
    widths = [64, 128, 320, 64, 200, 64, 96, 128, 256, 64]
    for i, tokens in enumerate(widths):
        if i < MIN_ROUNDS:
            assert model.break_even(64) == 0.0  # not fitted yet: verify every draft
        model.observe(tokens, 0.010 + 0.001 * tokens)
    fit = model.coefficients()
    assert fit is not None and fit == pytest.approx((0.010, 0.001))
    assert model.break_even(64) == pytest.approx(0.001 / (0.010 / 64 + 0.001))  # 0.865: a wide CPU batch
    assert model.break_even(1) == pytest.approx(0.001 / 0.011)  # one request: almost any draft pays


def test_cost_model_needs_rounds_of_different_widths() -> None:
    model = RoundCostModel()
    for _ in range(20):
        model.observe(64, 0.05)
    assert model.coefficients() is None and model.break_even(64) == 0.0


def test_acceptance_record_and_drafts_worth_verifying() -> None:
    state = DraftState()
    assert drafts_worth_verifying(state, 0.99, 4) == 4  # no record: optimistic, every draft is tried
    for _ in range(8):
        record_acceptance(state, proposed=3, accepted=1)  # first draft accepted, second rejected, third untried
    record_acceptance(state, proposed=3, accepted=0)
    record_acceptance(state, proposed=3, accepted=3)
    assert state.position_tries == [10, 9, 1] and state.position_hits == [9, 1, 1]
    # Chances: position 0 (9 + 2) / (10 + 2) = 0.917; then x (1 + 2) / (9 + 2) = 0.25; then x 3/3; then x 1.
    assert drafts_worth_verifying(state, 0.9, 4) == 1
    assert drafts_worth_verifying(state, 0.95, 4) == 0
    assert drafts_worth_verifying(state, 0.2, 4) == 4
    assert drafts_worth_verifying(state, 0.2, 2) == 2  # never more than the limit
    assert drafts_worth_verifying(state, 0.0, 0) == 0


def test_probe_rounds_while_every_round_has_one_width() -> None:
    """Without a second width the fit is unknown; then one round in PROBE_EVERY is a plain decode round, whose
    width (one token per request) gives the fit what it needs."""
    model = RoundCostModel()
    probes = []
    for _ in range(3 * PROBE_EVERY):
        probes.append(model.wants_probe())
        model.observe(64 if probes[-1] else 320, 0.020 if probes[-1] else 0.060)
    assert probes.count(True) == 1 and probes.index(True) >= MIN_ROUNDS  # the first probe suffices
    fit = model.coefficients()
    # Two widths on one line: 20 ms at 64 tokens, 60 ms at 320, so c1 = 0.04 s / 256 tokens and c0 = 10 ms.
    assert fit is not None and fit == pytest.approx((0.010, 0.04 / 256)) and not model.wants_probe()


def test_a_held_back_position_is_offered_again_once_its_record_fades() -> None:
    """10 failed tries at the first position, break-even 0.9: held back until 10 * 0.95**n <= 2/0.9 - 2 (the prior
    (0 + 2) / (tries + 2) back at 0.9), i.e. n = 75 rounds; one more failure, then 34 rounds (hand-computed:
    ln((2/0.9 - 2) / (10 * 0.95**75 + 1)) / ln(0.95) = 33.1)."""
    state = DraftState()
    for _ in range(10):
        record_acceptance(state, proposed=1, accepted=0)

    def rounds_held_back() -> int:
        rounds = 0
        while (offered := drafts_worth_verifying(state, 0.9, 4)) == 0:
            fade_held_back(state, offered)
            rounds += 1
        return rounds

    assert rounds_held_back() == 75
    record_acceptance(state, proposed=1, accepted=0)
    assert rounds_held_back() == 34
    # A position that is offered keeps its record; only the held-back ones fade.
    record_acceptance(state, proposed=2, accepted=1)
    tries, hits = list(state.position_tries), list(state.position_hits)
    fade_held_back(state, 1)
    assert state.position_tries[0] == tries[0] and state.position_tries[1] == pytest.approx(0.95 * tries[1])
    assert state.position_hits[1] == pytest.approx(0.95 * hits[1])
