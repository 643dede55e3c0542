"""Which tenants a canary takes (``components/tenancy/canary.py``): sticky, nested, and
close to its share over many tenants."""
from __future__ import annotations

import hashlib

from components.tenancy.canary import in_canary, point


def test_a_tenants_place_is_the_first_8_bytes_of_its_sha256():
    digest = hashlib.sha256(b"acme").digest()
    assert point("acme") == int.from_bytes(digest[:8], "big") / 2**64
    assert round(point("acme"), 4) == 0.5085 and round(point("gold"), 4) == 0.1439


def test_sticky_and_nested():
    assert in_canary("gold", 0.15) and not in_canary("gold", 0.14)
    assert not in_canary("acme", 0.5) and in_canary("acme", 0.51)
    assert all(in_canary(t, 1.0) for t in ("acme", "gold", "bronze", ""))
    tenants = [f"tenant-{i}" for i in range(2000)]
    for small, large in [(0.05, 0.1), (0.1, 0.5), (0.5, 0.9)]:
        inner = {t for t in tenants if in_canary(t, small)}
        outer = {t for t in tenants if in_canary(t, large)}
        assert inner <= outer                         # raising the share only adds tenants
    assert [in_canary(t, 0.3) for t in tenants] == [in_canary(t, 0.3) for t in tenants]


def test_the_share_taken_is_close_to_the_share():
    tenants = [f"tenant-{i}" for i in range(10000)]
    for share in (0.01, 0.1, 0.5):
        taken = sum(in_canary(t, share) for t in tenants) / len(tenants)
        assert abs(taken - share) < 0.02, (share, taken)
