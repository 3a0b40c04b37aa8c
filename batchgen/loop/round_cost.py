"""What a decode round costs against its width: the fit that sets how many drafts are worth verifying.

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
(:meth:`RoundCostModel.wants_probe`). Each request's side of the rule, its acceptance per draft position, is kept
by ``batchgen.speculative.draft_budget``.
"""

from __future__ import annotations

DECAY = 0.95  # weight of older rounds in the fit: about the last 20 rounds count
MIN_ROUNDS = 8  # rounds observed before the fit is trusted (until then every draft is verified)
PROBE_EVERY = 8  # without a fit after MIN_ROUNDS rounds, one round in this many decodes without drafts


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
