"""How many drafts are worth verifying for one request: its acceptance per draft position against the break-even
acceptance of ``batchgen.loop.round_cost.RoundCostModel``.

A request's record of the positions it is not offered fades a little each round (:func:`fade_held_back`), so one
whose text turned unpredictable is offered drafts again once the optimistic prior outweighs the faded failures:
its text may have become predictable since.
"""

from __future__ import annotations

from batchgen.speculative.draft_state import DraftState

RECORD_FADE = 0.95  # per round a draft position is held back, the weight its tries and hits keep


def record_acceptance(state: DraftState, proposed: int, accepted: int) -> None:
    """A verify round offered a request ``proposed`` drafts of its drafter and the first ``accepted`` matched.

    Draft position ``j`` (0-based) was tried when the ``j`` before it were accepted, and hit when it was too.
    """
    tries, hits = state.position_tries, state.position_hits
    while len(tries) < proposed:
        tries.append(0)
        hits.append(0)
    for j in range(min(proposed, accepted + 1)):
        tries[j] += 1
        hits[j] += j < accepted


def drafts_worth_verifying(state: DraftState, break_even: float, limit: int) -> int:
    """The most drafts (≤ ``limit``) whose chance of all being accepted stays at least ``break_even``.

    Position ``j``'s acceptance, given the ones before it were accepted, is estimated as ``(hits + 2) / (tries + 2)``:
    optimistic (1 for a position never tried), so a request keeps trying a position until its record says no.
    """
    chance, count = 1.0, 0
    tries, hits = state.position_tries, state.position_hits
    while count < limit:
        if count < len(tries):
            chance *= (hits[count] + 2) / (tries[count] + 2)
        if chance < break_even:
            break
        count += 1
    return count


def fade_held_back(state: DraftState, offered: int) -> None:
    """Fade the record of every draft position past the first ``offered``, which the request is not offered this round.

    A held-back position's record would otherwise never change. Fading tries and hits alike keeps their ratio and
    lets the optimistic prior of :func:`drafts_worth_verifying` win again: a position with 10 failed tries and no
    hit (estimate 2/12) is offered again at break-even 0.9 after 75 rounds held back (the first n with
    10 * 0.95**n <= 2/0.9 - 2), and after one more failure every 34 rounds: a verified position wasted per ~34
    tokens at worst.
    """
    tries, hits = state.position_tries, state.position_hits
    for j in range(offered, len(tries)):
        tries[j] *= RECORD_FADE
        hits[j] *= RECORD_FADE
