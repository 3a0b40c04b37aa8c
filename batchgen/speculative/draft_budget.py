"""How many drafts are worth verifying: each request's acceptance per draft position against the cost of a token.

A verified position costs about as much compute as a decoded token, and pays off only if its draft is accepted. With
round time ``c0 + c1 * tokens`` (``c0``: what a round costs whatever its width — weight reads, launches, host work;
``c1``: compute per token), a request in a batch of ``B`` pays ``c0 / B + c1`` per token plain decoding emits, and
``c1`` for each extra verified position. Draft ``d`` adds a token exactly when drafts ``1..d`` are all accepted, so
it is worth verifying while ``P(drafts 1..d accepted) >= c1 / (c0 / B + c1)``, the break-even acceptance. (A
first-order rule: once earlier drafts pay off, a round's cost per emitted token is below ``c0 / B + c1``, so it errs
toward drafting a little more. A draft model's own forwards are not in ``c0`` or ``c1``: for it the rule is
optimistic.) A GPU, memory-bound at decode batch sizes, has ``c1`` near 0 (draft everything); a CPU running a wide
batch is compute-bound (``c1`` dominates: draft only near-certain tokens); a CPU running one request is again
dominated by ``c0``. The model is fitted online from the engine's own DECODE and TARGET_VERIFY rounds, so the choice
follows the hardware, the model and the batch size without tuning. (Prefill rounds are left out: their attention
over whole prompts makes a token dearer than in a decode round, which would pull ``c0`` to 0 and the break-even to
1.) The fit needs rounds of different widths; while it has none — every request verifying the same number of drafts
every round — the scheduler runs every ``PROBE_EVERY``-th round as a plain decode round
(:meth:`RoundCostModel.wants_probe`).

A request's record of the positions it is not offered fades a little each round (:func:`fade_held_back`), so one
whose text turned unpredictable is offered drafts again once the optimistic prior outweighs the faded failures:
its text may have become predictable since.
"""

from __future__ import annotations

from batchgen.loop.req import Req

DECAY = 0.95  # weight of older rounds in the fit: about the last 20 rounds count
MIN_ROUNDS = 8  # rounds observed before the fit is trusted (until then every draft is verified)
PROBE_EVERY = 8  # without a fit after MIN_ROUNDS rounds, one round in this many decodes without drafts
RECORD_FADE = 0.95  # per round a draft position is held back, the weight its tries and hits keep


class RoundCostModel:
    """Weighted least-squares fit of round seconds ≈ ``c0 + c1 * tokens`` over the recent rounds."""

    def __init__(self) -> None:
        self.rounds = 0
        self._sums = [0.0] * 5  # weighted n, Σx, Σy, Σx², Σxy

    def observe(self, tokens: int, seconds: float) -> None:
        """Record one round that processed ``tokens`` tokens in ``seconds`` (forward, sampling, bookkeeping)."""
        self.rounds += 1
        x, y = float(tokens), seconds
        self._sums = [DECAY * s + v for s, v in zip(self._sums, (1.0, x, y, x * x, x * y))]

    def coefficients(self) -> tuple[float, float] | None:
        """``(c0, c1)`` in seconds and seconds per token, or ``None`` before ``MIN_ROUNDS`` rounds or while every
        round had the same width (the slope is then unknown)."""
        n, sx, sy, sxx, sxy = self._sums
        variance = n * sxx - sx * sx
        if self.rounds < MIN_ROUNDS or variance <= 1e-9 * max(1.0, n * sxx):
            return None
        c1 = max(0.0, (n * sxy - sx * sy) / variance)
        c0 = max(0.0, (sy - c1 * sx) / n)
        return c0, c1

    def wants_probe(self) -> bool:
        """Whether the next round should be a plain decode round, to give the fit a second width: after
        ``MIN_ROUNDS`` rounds without a fit, once every ``PROBE_EVERY`` rounds."""
        return self.rounds >= MIN_ROUNDS and self.rounds % PROBE_EVERY == 0 and self.coefficients() is None

    def break_even(self, batch_size: int) -> float:
        """The acceptance probability below which a draft costs more than it saves, ``c1 / (c0 / B + c1)`` for
        ``B = batch_size`` requests; 0 (verify every draft) until the fit is known."""
        fit = self.coefficients()
        if fit is None or batch_size < 1:
            return 0.0
        c0, c1 = fit
        per_token = c0 / batch_size + c1
        return c1 / per_token if per_token > 0 else 0.0


def record_acceptance(req: Req, proposed: int, accepted: int) -> None:
    """A verify round offered ``req`` ``proposed`` drafts of its drafter and the first ``accepted`` matched.

    Draft position ``j`` (0-based) was tried when the ``j`` before it were accepted, and hit when it was too.
    """
    tries, hits = req.draft_position_tries, req.draft_position_hits
    while len(tries) < proposed:
        tries.append(0)
        hits.append(0)
    for j in range(min(proposed, accepted + 1)):
        tries[j] += 1
        hits[j] += j < accepted


def drafts_worth_verifying(req: Req, break_even: float, limit: int) -> int:
    """The most drafts (≤ ``limit``) whose chance of all being accepted stays at least ``break_even``.

    Position ``j``'s acceptance, given the ones before it were accepted, is estimated as ``(hits + 2) / (tries + 2)``:
    optimistic (1 for a position never tried), so a request keeps trying a position until its record says no.
    """
    chance, count = 1.0, 0
    tries, hits = req.draft_position_tries, req.draft_position_hits
    while count < limit:
        if count < len(tries):
            chance *= (hits[count] + 2) / (tries[count] + 2)
        if chance < break_even:
            break
        count += 1
    return count


def fade_held_back(req: Req, offered: int) -> None:
    """Fade the record of every draft position past the first ``offered``, which ``req`` is not offered this round.

    A held-back position's record would otherwise never change. Fading tries and hits alike keeps their ratio and
    lets the optimistic prior of :func:`drafts_worth_verifying` win again: a position with 10 failed tries and no
    hit (estimate 2/12) is offered again at break-even 0.9 after 75 rounds held back (the first n with
    10 * 0.95**n <= 2/0.9 - 2), and after one more failure every 34 rounds: a verified position wasted per ~34
    tokens at worst.
    """
    tries, hits = req.draft_position_tries, req.draft_position_hits
    for j in range(offered, len(tries)):
        tries[j] *= RECORD_FADE
        hits[j] *= RECORD_FADE
