"""The canary's watchdog (``components/tenancy/watchdog.py``): each threshold crossed
exactly past its value and not at it, the windows forgetting, and promotion."""
from __future__ import annotations

import pytest

from components.tenancy.watchdog import Decided, Ended, Verdict, Watchdog
from schemas.config import RolloutConfig

CFG = RolloutConfig(mode="canary", share=0.5, window_s=10.0, min_requests=4,
                    max_miss_rate_increase=0.25, max_reject_rate_increase=0.25,
                    max_wait_increase_s=2.0, max_flip_rate_increase=0.25,
                    max_cost_ratio=2.0, promote_after_s=60.0)


def ends(w: Watchdog, at: float, canary: bool, n: int, cls: str = "interactive",
         **kw) -> None:
    for _ in range(n):
        w.ended(Ended(at, canary, cls, **kw))


def good(w: Watchdog, at: float, canary: bool, n: int, **kw) -> None:
    ends(w, at, canary, n, computed_tokens=20, good_tokens=10, wait_s=0.1, **kw)


def test_a_class_miss_rate_past_its_increase_rolls_back_and_at_it_does_not():
    w = Watchdog(CFG, 0.0)
    good(w, 1.0, False, 4)
    good(w, 1.0, True, 3)
    ends(w, 1.0, True, 1, missed=True, computed_tokens=20, wait_s=0.1)
    assert w.verdict(2.0) is None                         # 1/4 = 0.25: at the increase
    ends(w, 1.5, True, 1, missed=True, computed_tokens=20, wait_s=0.1)
    v = w.verdict(2.0)                                    # 2/5 = 0.40 against 0
    assert v == Verdict("rollback", "deadline-miss rate of class interactive 0.40 on the "
                                    "canary against 0.00 (more than +0.25)")


def test_misses_are_compared_per_class_and_need_min_requests_on_the_canary():
    w = Watchdog(CFG, 0.0)
    good(w, 1.0, False, 8, cls="batch")
    ends(w, 1.0, True, 3, cls="batch", missed=True)       # 3 < min_requests
    good(w, 1.0, True, 4)
    assert w.verdict(2.0) is None
    ends(w, 1.0, False, 4, cls="batch", missed=True)      # baseline batch: 4/12 = 0.33
    ends(w, 1.0, True, 1, cls="batch", missed=True)       # canary batch: 4/4 = 1.0
    assert w.verdict(2.0).reason == ("deadline-miss rate of class batch 1.00 on the canary "
                                     "against 0.33 (more than +0.25)")


def test_the_window_forgets_what_is_older():
    w = Watchdog(CFG, 0.0)
    ends(w, 1.0, True, 4, missed=True)
    assert w.verdict(11.0).action == "rollback"           # 1.0 is inside [1.0, 11.0]
    assert w.verdict(11.5) is None                         # forgotten
    assert not w.ends


def test_rejection_rate():
    w = Watchdog(CFG, 0.0)
    good(w, 1.0, False, 3)
    ends(w, 1.0, False, 1, rejected=True)                 # baseline 0.25
    good(w, 1.0, True, 2)
    ends(w, 1.0, True, 2, rejected=True)                  # canary 0.50: +0.25, at it
    assert w.verdict(2.0) is None
    ends(w, 1.0, True, 1, rejected=True)                  # 3/5 = 0.60
    assert w.verdict(2.0).reason == ("rejection rate 0.60 on the canary against 0.25 (more "
                                     "than +0.25)")


def test_starvation_counts_ended_and_still_waiting_requests():
    w = Watchdog(CFG, 0.0)
    ends(w, 1.0, False, 1, cls="batch", wait_s=1.0)
    ends(w, 1.0, True, 1, cls="batch", wait_s=3.0)        # +2.0: at it
    assert w.verdict(2.0) is None
    assert w.verdict(2.0, {(True, "batch"): 3.5}).reason == (
        "longest wait of class batch 3.50 s on the canary against 1.00 s (more than +2 s)")
    assert w.verdict(2.0, {(True, "batch"): 3.5, (False, "batch"): 2.0}) is None


def test_decisions_flipping_for_one_tenant_and_class():
    w = Watchdog(CFG, 0.0)
    for i, admitted in enumerate([True, False, True, True]):      # 2 flips of 4: 0.5
        w.decided(Decided(1.0 + i / 10, True, "t", "interactive", admitted))
    for admitted in [True, False, True, False]:                   # baseline 3 of 4
        w.decided(Decided(1.0, False, "u", "interactive", admitted))
    assert w.verdict(2.0) is None
    # other tenants' and classes' decisions never flip against t's
    for tenant, cls, admitted in [("t2", "interactive", False), ("t", "batch", False),
                                  ("t", "batch", False), ("t", "batch", False)]:
        w.decided(Decided(1.5, True, tenant, cls, admitted))
    assert w.verdict(2.0) is None                          # 2/8 against 3/4
    w2 = Watchdog(CFG, 0.0)
    for admitted in [True, False, True, False, True]:             # 4 of 5: 0.8
        w2.decided(Decided(1.0, True, "t", "interactive", admitted))
    for _ in range(4):
        w2.decided(Decided(1.0, False, "u", "interactive", True))
    assert w2.verdict(2.0).reason == ("decisions flipping 0.80 of the canary's against 0.00 "
                                      "(more than +0.25)")


def test_cost_per_good_token():
    w = Watchdog(CFG, 0.0)
    ends(w, 1.0, False, 4, computed_tokens=30, good_tokens=10)     # 3.0 per good token
    ends(w, 1.0, True, 4, computed_tokens=60, good_tokens=10)      # 6.0: 2x, at it
    assert w.verdict(2.0) is None
    ends(w, 1.0, True, 1, computed_tokens=10)                      # 250/40 = 6.25
    assert w.verdict(2.0).reason == ("cost 6.25 tokens computed per good token on the canary "
                                     "against 3.00 (more than 2x)")
    w2 = Watchdog(CFG, 0.0)
    ends(w2, 1.0, False, 4, computed_tokens=30, good_tokens=10)
    ends(w2, 1.0, True, 4, computed_tokens=30)
    assert w2.verdict(2.0).reason == ("cost: the canary computed 120 tokens and no good one "
                                      "(the baseline 3.00 per good token)")
    w3 = Watchdog(CFG, 0.0)                                        # no baseline: no ratio
    ends(w3, 1.0, True, 4, computed_tokens=30)
    assert w3.verdict(2.0) is None


def test_promotes_after_promote_after_s_with_enough_canary_requests():
    w = Watchdog(CFG, 5.0)
    good(w, 6.0, True, 3)
    assert w.verdict(65.0) is None                         # 3 canary requests < 4
    good(w, 64.0, True, 1)
    assert w.verdict(64.9) is None                         # 59.9 s
    assert w.verdict(65.0) == Verdict("promote", "held 60.0 s over 4 canary requests")


def test_a_threshold_crossed_at_promotion_time_rolls_back_instead():
    w = Watchdog(CFG, 0.0)
    good(w, 50.0, False, 4)
    ends(w, 55.0, True, 4, missed=True)
    assert w.verdict(60.0).action == "rollback"


@pytest.mark.parametrize("bad", [{"share": 0.0}, {"share": 1.5}, {"window_s": 0.0},
                                 {"min_requests": 0}, {"max_cost_ratio": 0.5},
                                 {"max_wait_increase_s": -1.0}])
def test_rollout_config_refuses_bad_values(bad):
    from schemas.config import ConfigError
    with pytest.raises(ConfigError):
        RolloutConfig(**bad)
