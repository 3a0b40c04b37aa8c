"""The prefill and decode rates ``batchgen run``'s progress bar shows: over the last seconds, not since the start
(a rate since the start sinks towards 0 once the last prompts are prefilled, while decode still runs)."""

from __future__ import annotations

from collections import deque


class RecentRates:
    """Token rates (tokens/s) over the last ``window`` seconds of cumulative counts.

    Args:
        start: the time counting starts (seconds, any monotonic clock), when both counts are 0.
        window: seconds of history a rate covers (at least the span from the newest sample older than that).
    """

    def __init__(self, start: float, window: float = 10.0) -> None:
        self.window = window
        self._samples: deque[tuple[float, int, int]] = deque([(start, 0, 0)])

    def update(self, now: float, prefill_tokens: int, decode_tokens: int) -> tuple[float, float]:
        """Record the cumulative counts at ``now``; return (prefill, decode) tokens/s since the oldest sample
        kept: the newest one at least ``window`` seconds old, or the start."""
        self._samples.append((now, prefill_tokens, decode_tokens))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window:
            self._samples.popleft()
        then, prefill_then, decode_then = self._samples[0]
        span = now - then
        if span <= 0:
            return 0.0, 0.0
        return (prefill_tokens - prefill_then) / span, (decode_tokens - decode_then) / span
