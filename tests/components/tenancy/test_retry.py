"""Retry-After from the recent rate at which requests end."""
from components.tenancy.retry import DrainRate


def test_cold_start_assumes_half_a_request_per_second():
    assert DrainRate().retry_after(3, now=100.0) == 6.0


def test_backlog_over_the_recent_rate_clamped_to_1_60():
    d = DrainRate()
    for t in range(10):                      # 10 ends over 9 s: ~1.11 per second
        d.ended(100.0 + t)
    assert d.retry_after(5, now=109.0) == 4.5
    assert d.retry_after(1, now=109.0) == 1.0
    assert d.retry_after(10_000, now=109.0) == 60.0


def test_ends_older_than_the_window_do_not_count():
    d = DrainRate(window_s=30)
    d.ended(0.0)
    d.ended(1.0)
    assert d.retry_after(3, now=100.0) == 6.0     # back to the cold-start rate
