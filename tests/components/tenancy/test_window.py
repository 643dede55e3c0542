"""Recent token use per tenant (components/tenancy/window.py) and the token bucket level it
rebuilds: exact seconds, exact tokens."""
from components.tenancy.bucket import TokenBucket
from components.tenancy.window import UsageWindow, rebuilt_level


def test_windows_count_whole_seconds_never_short():
    w = UsageWindow()
    w.add("a", 10, 100.2)
    w.add("a", 5, 100.9)            # same second: one slot
    w.add("a", 7, 103.5)
    w.add("b", 0, 103.5)            # nothing used: nothing kept
    assert w.used("a", 1, 103.9) == 7
    assert w.used("a", 2, 103.9) == 7
    assert w.used("a", 4, 103.9) == 22       # slots 99.. 103
    assert w.used("a", 64, 103.9) == 22
    assert w.used("b", 64, 103.9) == 0
    s = w.stats(103.9)
    assert s["used_tokens.1s.a"] == 7 and s["used_tokens.4s.a"] == 22
    assert s["used_tokens.64s.a"] == 22 and not any(k.endswith(".b") for k in s)
    assert w.stats(200.0) == {}              # a minute idle: forgotten


def test_old_slots_fall_off():
    w = UsageWindow()
    for t in range(0, 100):
        w.add("a", 1, float(t))
    assert w.used("a", 64, 99.5) == 65       # seconds 35..99
    assert len(w._slots["a"]) == 65


def test_the_rebuilt_level_bounds_a_bucket_charged_the_same():
    """A bucket of 100/s, burst 200, charged 150 at t=9.5 and 120 at t=10.5 holds 80 at
    t=11 (its least bound is from t=9.5: 200 + 150 - 270). The windows see 120 tokens in
    the last second and 270 in the last two: bounds 180 and 130, so 130: high by the 0.5 s
    between the true start and the 2 s window, at 100/s."""
    b = TokenBucket(100, 200, 0.0)
    w = UsageWindow()
    for t, n in ((9.5, 150), (10.5, 120)):
        b.take(n, t)
        w.add("a", n, t)
    used = {s: w.used("a", s, 11.0) for s in (1, 2, 4)}
    assert used == {1: 120, 2: 270, 4: 270}
    assert b.refill(11.0) == 80.0
    assert rebuilt_level(100, 200, used) == 130.0
    # a restart with full buckets would give 200: 120 tokens more than the exact level
    assert rebuilt_level(100, 200, {1: 0, 64: 0}) == 200
    assert rebuilt_level(100, 200, {}) == 200
    assert rebuilt_level(100, 200, {1: 500, 2: 500}) == -200   # debt carries over
