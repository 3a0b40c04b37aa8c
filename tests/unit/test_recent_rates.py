"""The progress bar's prefill/decode rates: over the last seconds, by hand-computed counts."""

from __future__ import annotations

import pytest

from batchgen.job.recent_rates import RecentRates


def test_rates_cover_the_last_window_not_the_whole_run() -> None:
    rates = RecentRates(start=100.0, window=10.0)
    # Prefill 1,000 tokens in the first 5 s, then only decode at 50 tokens/s.
    assert rates.update(105.0, 1000, 0) == pytest.approx((200.0, 0.0))  # since the start: 1000 / 5
    assert rates.update(110.0, 1000, 250) == pytest.approx((100.0, 25.0))  # still since the start: 10 s
    assert rates.update(115.0, 1000, 500) == pytest.approx((0.0, 50.0))  # since 105: (500 - 0) / 10
    assert rates.update(130.0, 1000, 1250) == pytest.approx((0.0, 50.0))  # since 115: 750 / 15
    # A run-long average would read 1000 / 30 = 33 prefill tokens/s here, with no prefill for 25 s.


def test_no_time_passed_is_a_zero_rate() -> None:
    assert RecentRates(start=5.0).update(5.0, 10, 10) == (0.0, 0.0)
