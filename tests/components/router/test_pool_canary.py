"""A canary by replica pool's pure rules (components/router/pool_canary.py): which
candidates are one and which are refused, what each replica of the pool is sent, how a
placement's answer is counted, the version a replica is rolled back to, which side a
placement counts on; and the pieces around it: pools on replicas, per-pool discovery, and
a trial left by a router that stopped."""
from __future__ import annotations

import msgspec
import pytest

from components.router import pool_canary as pc
from components.router.discovery import DnsResolver, Pools, resolver_for
from components.router.live_config import RouterLiveConfig
from components.tenancy.watchdog import Decided, Ended, Watchdog
from schemas.client import (
    Accepted,
    Cancelled,
    Failed,
    Finished,
    Rejected,
    RequestTiming,
    Usage,
)
from schemas.config import ConfigError, ReplicaSpec, RolloutConfig, load_config
from schemas.config_change import ConfigVersion, Refused, candidate
from weir.forms import replica_address

BOOT = load_config(None, topology={"run_dir": "/tmp/weir-test"},
                   admission={"tenants": [{"name": "a"}, {"name": "b"}]},
                   router={"replicas": [{"name": "s0", "endpoint": "ipc:///s0",
                                         "pool": "stable"},
                                        {"name": "c0", "endpoint": "ipc:///c0",
                                         "pool": "canary"}]})
CANARY = '[rollout]\nmode = "canary"\npool = "canary"\nwindow_s = 10.0\nmin_requests = 2\n'


def test_a_candidate_without_a_pool_is_not_one():
    assert pc.parse(BOOT, BOOT, '[router]\npolicy = "round_robin"\n') is None
    assert pc.parse(BOOT, BOOT, '[rollout]\nmode = "canary"\nshare = 0.5\n') is None
    assert pc.parse(BOOT, BOOT, "not toml [") is None


def test_a_pool_candidate_carries_only_engine_policy():
    r = pc.parse(BOOT, BOOT, '[router]\npolicy = "round_robin"\n[kv]\nnum_blocks = 9\n'
                 + CANARY)
    assert isinstance(r, Refused) and r.reasons == (
        "[kv] is not an engine's policy: a canary by pool carries only [admission], "
        "[scheduler], [speculative], [rollout] (apply the rest separately)",
        "[router] is not an engine's policy: a canary by pool carries only [admission], "
        "[scheduler], [speculative], [rollout] (apply the rest separately)")
    r = pc.parse(BOOT, BOOT, '[scheduler]\nmax_num_batched_tokens = 64\n' + CANARY)
    assert isinstance(r, Refused) and r.reasons[0].startswith(
        "scheduler.max_num_batched_tokens needs a restart")
    r = pc.parse(BOOT, BOOT, '[admission]\ntenants = [{ name = "a" }, { name = "b" }, '
                             '{ name = "c" }]\n' + CANARY)
    assert isinstance(r, Refused) and "adds the tenant c" in r.reasons[0]
    r = pc.parse(BOOT, BOOT, CANARY)
    assert r == Refused(("the candidate changes no engine policy: nothing to try on a pool",))
    with pytest.raises(ConfigError):
        RolloutConfig(pool="canary")                 # a pool goes with mode "canary"
    with pytest.raises(ConfigError):
        RolloutConfig(mode="canary", pool="Bad Pool")


def test_what_the_pool_is_sent_is_the_candidate_less_its_rollout():
    text = ('[admission]\npolicy = "fcfs"\nttft_headroom = 0.25\n'
            'classes = [{ name = "interactive", ttft_slo_ms = 500, late = "drop" }, '
            '{ name = "batch", priority = 3 }]\n'
            '[scheduler]\nfairness = "fcfs"\n' + CANARY)
    cand = pc.parse(BOOT, BOOT, text)
    assert isinstance(cand, pc.Candidate)
    assert cand.pool == "canary" and cand.rollout.window_s == 10.0
    assert cand.config.rollout.mode == "canary" and cand.config.admission.policy == "fcfs"
    assert "[rollout]" not in cand.engine_toml
    sent = msgspec.toml.decode(cand.engine_toml.encode())
    assert sent == {k: v for k, v in msgspec.toml.decode(text.encode()).items()
                    if k != "rollout"}
    # laid over a replica's config it is exactly the candidate's policy, mode off
    on_replica = candidate(BOOT, cand.engine_toml)
    assert on_replica.admission == cand.config.admission
    assert on_replica.scheduler == cand.config.scheduler and on_replica.rollout.mode == "off"


def test_toml_of_writes_every_kind_of_value():
    tables = {"a": {"s": 'q"\\\n\u00e9', "i": -3, "f": 1e-05, "big": 1e+20, "t": True,
                    "l": [1, 2.5], "d": {"x y": 1, "n": None}, "n": None,
                    "aot": [{"k": "v"}, {"k": "w", "m": [False]}]}}
    text = pc.toml_of(tables)
    back = msgspec.toml.decode(text.encode())
    assert back == {"a": {"s": 'q"\\\n\u00e9', "i": -3, "f": 1e-05, "big": 1e+20, "t": True,
                          "l": [1, 2.5], "d": {"x y": 1},
                          "aot": [{"k": "v"}, {"k": "w", "m": [False]}]}}


def test_a_placement_is_counted_by_its_answer():
    assert pc.placement_decision(Accepted("r", 10), 1.0, True, "a", "c") == \
        Decided(1.0, True, "a", "c", True)
    assert pc.placement_decision(Rejected("r", "overloaded", ""), 1.0, False, "a", "c") == \
        Decided(1.0, False, "a", "c", False)
    assert pc.placement_decision(Rejected("r", "invalid_request", ""), 1.0, True, "a",
                                 "c") is None
    done = Finished("r", "length", Usage(100, 16, 40))
    # first token 0.250 s after arrival, deadline 0.300 s: good
    assert pc.placement_end(done, 2.0, True, "c", 1.0, 1.250, 0.300, True) == \
        Ended(2.0, True, "c", False, False, 0.25, 76, 16)
    # 0.301 s: a miss, no good tokens
    assert pc.placement_end(done, 2.0, True, "c", 1.0, 1.301, 0.300, True) == \
        Ended(2.0, True, "c", True, False, pytest.approx(0.301), 76, 0)
    # not streamed: its first token was decode_s before its end
    timed = Finished("r", "length", Usage(100, 16, 40), timing=RequestTiming(decode_s=0.75))
    assert pc.placement_end(timed, 2.0, True, "c", 1.0, 0.0, 0.3, True).wait_s == 0.25
    assert pc.placement_end(timed, 2.1, True, "c", 1.0, 0.0, 0.3, True).missed
    # no deadline: good whatever its wait; cut at its end-to-end bound: a miss
    assert not pc.placement_end(done, 2.0, False, "c", 1.0, 1.9, None, True).missed
    cut = Finished("r", "deadline", Usage(100, 4, 0))
    assert pc.placement_end(cut, 2.0, False, "c", 1.0, 1.1, None, True).missed
    # a refusal for load: rejected, no wait unless it was admitted first
    assert pc.placement_end(Rejected("r", "queue_full", ""), 2.0, True, "c", 1.0, 0.0, 0.3,
                            False) == Ended(2.0, True, "c", rejected=True, wait_s=None)
    assert pc.placement_end(Rejected("r", "deadline_expired", ""), 2.5, True, "c", 1.0, 0.0,
                            0.3, True).wait_s == 1.5
    for other in (Failed("r", "x"), Cancelled("r", "x"), Rejected("r", "invalid_request", "")):
        assert pc.placement_end(other, 2.0, True, "c", 1.0, 0.0, 0.3, True) is None
    assert pc.waiting({(True, "c"): 1.0}, True, "c", 0.5) == {(True, "c"): 1.0}
    assert pc.waiting({(True, "c"): 1.0}, False, "c", 0.5) == {(True, "c"): 1.0,
                                                               (False, "c"): 0.5}


def _v(n: int, by: str) -> ConfigVersion:
    return ConfigVersion(n, "x", by, 0.0)


def test_the_version_a_replica_gets_back():
    marker = pc.actor(7)
    assert marker == "router canary v7"
    history = [_v(0, "startup"), _v(1, "operator:ops"), _v(2, f"service:default ({marker})")]
    assert pc.pre_trial_version(history, marker) == 1
    # restarted with its history and applied again: still the one before the first
    history.append(_v(3, f"operator:operator ({marker})"))
    assert pc.pre_trial_version(history, marker) == 1
    assert pc.pre_trial_version(history, pc.actor(8)) is None       # not this trial's
    assert pc.pre_trial_version([_v(0, "startup")], marker) is None


def test_which_side_a_placement_counts_on():
    t = pc.PoolTrial(3, pc.Candidate("canary", RolloutConfig(), "", BOOT), None,
                     Watchdog(RolloutConfig(), 10.0))
    t.applied["c0"] = pc.Placed(1, 2, 10.5)
    assert t.side("s0", "stable", 9.999) is None           # before the trial
    assert t.side("s0", "stable", 10.0) is False
    assert t.side("c0", "canary", 10.2) is None            # before c0 took it
    assert t.side("c0", "canary", 10.5) is True
    assert t.side("c1", "canary", 11.0) is None            # a pool replica without it
    assert t.actor == "router canary v3"


def test_the_watchdog_rolls_back_a_pool_that_misses_within_the_window():
    """Exact to the millisecond: the canary's second miss is the verdict."""
    cfg = RolloutConfig(mode="canary", pool="canary", window_s=10.0, min_requests=2,
                        max_miss_rate_increase=0.25, promote_after_s=30.0)
    w = Watchdog(cfg, 100.0)
    done = Finished("r", "length", Usage(10, 4))
    for at in (100.100, 100.200):
        w.ended(pc.placement_end(done, at, False, "c", at - 0.1, at - 0.09, 0.05, True))
    w.ended(pc.placement_end(done, 100.300, True, "c", 100.2, 100.26, 0.05, True))
    assert w.verdict(100.300) is None                    # one canary request: not judged
    w.ended(pc.placement_end(done, 100.301, True, "c", 100.201, 100.3, 0.05, True))
    v = w.verdict(100.301)
    assert v is not None and v.action == "rollback"
    assert v.reason.startswith("deadline-miss rate of class c 1.00 on the canary against 0.00")
    # a good one holds promote_after_s, then promotes
    good = Watchdog(cfg, 100.0)
    for at in (100.1, 100.2):
        good.ended(pc.placement_end(done, at, True, "c", at - 0.1, at - 0.09, 0.05, True))
    assert good.verdict(129.999) is None
    assert good.verdict(130.0).action == "promote"


def test_replicas_carry_a_pool():
    assert ReplicaSpec("r", "ipc:///r").pool == "default"
    with pytest.raises(ConfigError, match="pool must be"):
        ReplicaSpec("r", "ipc:///r", pool="")
    assert replica_address("r=tcp://h:1,tcp://h:2,canary").pool == "canary"
    assert replica_address("r=tcp://h:1,,canary").kv_events == ""
    assert replica_address("r=tcp://h:1").pool == "default"
    assert [r.pool for r in BOOT.router.replicas] == ["stable", "canary"]


def test_discovery_by_pool_labels_what_each_name_finds():
    a = {"s0": ReplicaSpec("s0", "tcp://1.1.1.1:1", pool="stable")}
    b = {"c0": ReplicaSpec("c0", "tcp://1.1.1.2:1", pool="canary"),
         "s0": ReplicaSpec("s0", "tcp://9.9.9.9:1", pool="canary")}
    assert Pools([lambda: a, lambda: b])() == {"s0": a["s0"], "c0": b["c0"]}
    assert Pools([lambda: a, lambda: None])() is None
    one = resolver_for("weir-replicas", {}, 7450, 0)
    assert isinstance(one, DnsResolver) and one.pool == "default"
    both = resolver_for("", {"stable": "weir-stable", "canary": "weir-canary"}, 7450, 7470)
    assert isinstance(both, Pools)
    assert [(r.name, r.pool) for r in both.resolvers] == [("weir-stable", "stable"),
                                                          ("weir-canary", "canary")]
    with pytest.raises(ConfigError, match="discovery_pools"):
        load_config(None, topology={"run_dir": "/x"},
                    router={"discovery": "dns", "discovery_pools": {"Bad": "x"}})
    ok = load_config(None, topology={"run_dir": "/x"},
                     router={"discovery": "dns", "discovery_pools": {"canary": "x"}})
    assert ok.router.discovery_pools == {"canary": "x"}


def test_a_trial_left_by_a_stopped_router_is_rolled_back_at_its_start(tmp_path):
    path = tmp_path / "history.jsonl"
    live = RouterLiveConfig(BOOT, path, 1.0)
    cand = pc.parse(live.config, BOOT, '[admission]\nttft_headroom = 0.4\n' + CANARY)
    assert isinstance(cand, pc.Candidate)
    v = live.begin_trial(cand.config, "operator:ops", 2.0)
    assert v.version == 1 and v.rollout == "canary" and live.orphan is None
    again = RouterLiveConfig(BOOT, path, 3.0)
    assert again.orphan == (1, "canary")
    h = again.history
    assert h.trial is None and h.current.version == 2 and h.current.rollback_of == 0
    assert h.current.applied_by == "watchdog" and "restarted" in h.current.reason
    third = RouterLiveConfig(BOOT, path, 4.0)       # saved: not rolled back twice
    assert third.orphan is None and third.history.current.version == 2
