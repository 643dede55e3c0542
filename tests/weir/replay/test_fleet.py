"""The fleet simulator: autoscaler rules as pure functions, cold start, drain on
scale-down, and a burst that the leading rule answers before the lagging one."""
from __future__ import annotations

import math

import pytest

from components.router.routing import RoutingCore
from schemas.config import load_config
from weir.replay.autoscale import LOAD_CEILING, Rule, Signals, parse_rule, recommend, stabilise
from weir.replay.fleet import FleetSim
from weir.replay.profile import CostProfile
from weir.replay.sim import Simulator, fast_block_hashes
from weir.replay.synth import TokenSynth
from weir.replay.types import COMPLETED, TraceRequest

STEP_S = 0.010
FLAT = CostProfile(coef=[STEP_S, 0.0, 0.0, 0.0, 0.0])


def config(**sections):
    sections.setdefault("admission", {"policy": "fcfs", "classes": []})
    sections.setdefault("speculative", {"method": "off"})     # (the fleet's mechanics alone)
    return load_config(None, topology={"run_dir": "/nonexistent"}, **sections)


def req(i, t, n_in=20, n_out=5):
    return TraceRequest(index=i, arrival_s=t, input_tokens=n_in, output_tokens=n_out)


def fleet(rule, requests, cfg=None, profile=FLAT, **kw):
    cfg = cfg or config()
    synth = TokenSynth(range(1000, 5000), 32, seed=7)
    sim = FleetSim(cfg, profile, rule, tokens=synth.tokens,
                   hashes=fast_block_hashes(cfg.kv.block_size), **kw)
    return sim, sim.run(requests)


# --------------------------------------------------------------------------- rules, pure
def sig(**kw):
    base = {"t_s": 0.0, "current": 2, "ready": 2}
    return Signals(**{**base, **kw})


def test_fixed_recommends_its_count():
    assert recommend(Rule("fixed", 3), sig(rps=100.0, queue_s=50.0)) == 3


def test_rps_is_the_hpa_formula_with_its_tolerance():
    rule = Rule("rps", 2.0)
    assert recommend(rule, sig(rps=9.0)) == 5              # ceil(9 / 2)
    assert recommend(rule, sig(rps=4.3)) == 2              # within 10% of 2 × 2: hold
    assert recommend(rule, sig(rps=1.0)) == 1


def test_util_counts_the_starting_replicas_as_idle_as_hpa_does():
    rule = Rule("util", 0.5)
    assert recommend(rule, sig(current=2, ready=2, utilisation=1.0)) == 4   # ceil(2 × 1 / .5)
    # two more starting: 4 in all is what the ready ones' load needs; not 4 more
    assert recommend(rule, sig(current=4, ready=2, utilisation=1.0)) == 4
    assert recommend(rule, sig(current=3, ready=2, utilisation=1.0)) == 4
    assert recommend(rule, sig(utilisation=0.2)) == 1
    assert recommend(rule, sig(utilisation=0.52)) == 2                      # within 10%
    assert recommend(rule, sig(current=2, ready=0, utilisation=0.0)) == 2   # no metric


def test_headroom_asks_for_the_fewest_replicas_that_hold_the_queue_target():
    rule = Rule("headroom", 0.25)                # target: 0.25 × 2 s = 0.5 s of queue
    assert recommend(rule, sig(queue_s=2.0, ttft_slo_s=2.0)) == 8        # 2 × 2.0 / 0.5
    assert recommend(rule, sig(queue_s=0.52, ttft_slo_s=2.0)) == 2       # within 10%: hold
    # replicas starting share the ready ones' backlog when they serve: 2 × 1.0 / 0.5 = 4
    # in all, so with 2 already starting it holds (it asked 2 × 2 / .5 = 8 before)
    assert recommend(rule, sig(current=4, ready=2, queue_s=1.0, ttft_slo_s=2.0)) == 4
    # one fewer is asked for only when the backlog over one fewer stays under the target
    four = {"current": 4, "ready": 4, "ttft_slo_s": 2.0}
    assert recommend(rule, sig(queue_s=0.40, **four)) == 4     # over 3: 0.53 s > 0.5
    assert recommend(rule, sig(queue_s=0.37, **four)) == 3     # over 3: 0.49 s
    assert recommend(rule, sig(queue_s=0.05, **four)) == 1


def test_headroom_shrinks_to_what_the_prompt_tokens_need_not_one_at_a_time():
    rule = Rule("headroom", 0.25)
    six = {"current": 6, "ready": 6, "ttft_slo_s": 2.0, "queue_s": 0.05}
    # 6,000 prompt tokens/s against 4,000/s of prefill a replica, filled to LOAD_CEILING
    n = math.ceil(6000 / (4000 * LOAD_CEILING))
    assert 1 < n < 5
    assert recommend(rule, sig(prompt_tps=6000.0, capacity_tps=4000.0, **six)) == n
    # and the prompt rate asks for more before any queue has built
    assert recommend(rule, sig(current=2, ready=2, ttft_slo_s=2.0, queue_s=0.0,
                               prompt_tps=6000.0, capacity_tps=4000.0)) == n
    assert recommend(rule, sig(prompt_tps=6000.0, capacity_tps=0.0, **six)) == 1  # no rate


def test_stabilisation_up_at_once_down_to_the_window_max():
    rule = Rule("rps", 1.0, min_replicas=1, max_replicas=10, up_window_s=0.0,
                down_window_s=30.0)
    assert stabilise(rule, [(0.0, 2), (10.0, 6)], 10.0, 2) == 6           # up at once
    # down: the highest recommendation of the last 30 s
    assert stabilise(rule, [(0.0, 6), (10.0, 3), (20.0, 1)], 20.0, 6) == 6
    assert stabilise(rule, [(0.0, 6), (10.0, 3), (40.0, 1)], 40.0, 6) == 3
    assert stabilise(rule, [(50.0, 1)], 50.0, 6) == 1


def test_stabilisation_up_window_waits_for_a_sustained_recommendation():
    rule = Rule("rps", 1.0, up_window_s=10.0, down_window_s=0.0)
    assert stabilise(rule, [(0.0, 2), (5.0, 8)], 5.0, 2) == 2             # min is 2
    assert stabilise(rule, [(0.0, 2), (5.0, 8), (15.0, 8)], 15.0, 2) == 8


def test_bounds_clamp():
    rule = Rule("rps", 1.0, min_replicas=2, max_replicas=4)
    assert stabilise(rule, [(0.0, 9)], 0.0, 3) == 4
    assert stabilise(rule, [(0.0, 0)], 0.0, 3) == 2


def test_parse_rule():
    assert parse_rule("headroom:0.3", max_replicas=6) == Rule("headroom", 0.3, max_replicas=6)
    fixed = parse_rule("fixed:4", max_replicas=2)
    assert (fixed.initial, fixed.min_replicas, fixed.max_replicas) == (4, 4, 4)
    for bad in ("cpu:0.5", "rps", "fixed:0", "util:-1"):
        with pytest.raises(ValueError):
            parse_rule(bad)


# --------------------------------------------------------------------------- the fleet
def test_the_router_is_the_production_routing_core():
    sim, _ = fleet(Rule("fixed", 2), [req(0, 0.0)])
    assert type(sim.router) is RoutingCore
    assert all(type(s) is not Simulator and isinstance(s, Simulator) for s in sim.all_sims)


def test_one_replica_fleet_matches_the_single_simulator():
    reqs = [req(i, i * 0.5, n_in=30 + 7 * i, n_out=3 + i) for i in range(6)]
    cfg = config()
    synth = TokenSynth(range(1000, 5000), 32, seed=7)
    single = Simulator(cfg, FLAT, tokens=synth.tokens,
                       hashes=fast_block_hashes(cfg.kv.block_size)).run(reqs)
    _, res = fleet(Rule("fixed", 1), reqs, cfg)
    assert [(r.ttft_s, r.e2e_s, r.output_tokens) for r in res.run.records] == \
        [(r.ttft_s, r.e2e_s, r.output_tokens) for r in single.records]


def test_requests_spread_over_a_fixed_fleet_and_cost_is_replicas_times_time():
    reqs = [req(i, 0.0, n_in=200, n_out=10) for i in range(4)]
    sim, res = fleet(Rule("fixed", 2), reqs)
    assert all(r.terminal == COMPLETED for r in res.run.records)
    assert {sim.where[i].name for i in range(4)} == {"replica-0", "replica-1"}
    assert res.max_alive == 2
    assert res.replica_seconds == pytest.approx(2 * res.run.duration_s)


def test_cold_start_delays_service():
    # one replica, a slow prompt backlog; the autoscaler adds a second at t=1 s (the
    # first evaluation); with a 3 s cold start it serves from 4 s, never before
    reqs = [req(i, 0.1 * i, n_in=20, n_out=200) for i in range(60)]
    rule = Rule("rps", 1.0, min_replicas=1, max_replicas=2, down_window_s=100.0)
    sim, res = fleet(rule, reqs, cold_start_s=3.0, scale_interval_s=1.0)
    second = sim.all_sims[1]
    assert second.born_ns == 1_000_000_000 and second.ready_ns == 4_000_000_000
    served_there = [i for i, s in sim.where.items() if s is second]
    assert served_there and min(reqs[i].arrival_s for i in served_there) >= 4.0
    # paid from the moment it was asked for
    assert res.replica_seconds == pytest.approx(
        res.run.duration_s + (res.run.duration_s - 1.0), abs=1e-6)


def test_scale_down_drains_the_replica_and_its_work_finishes():
    # two replicas busy with long requests; demand stops, rps recommends 1: one replica
    # retires, takes nothing new, finishes what it has, then is gone
    reqs = [req(i, 0.0, n_in=20, n_out=300) for i in range(4)] + [req(4, 2.5, n_out=2)]
    rule = Rule("rps", 1.0, min_replicas=1, max_replicas=2, down_window_s=0.0)
    sim, res = fleet(rule, reqs, initial=2, scale_interval_s=1.0)
    assert all(r.terminal == COMPLETED and r.output_tokens == r_.output_tokens
               for r, r_ in zip(res.run.records, reqs, strict=True))
    gone = [s for s in sim.all_sims if s.gone_ns is not None]
    assert len(gone) == 1
    drained = gone[0]
    assert drained.gone_ns > 2_000_000_000         # it finished its 300-token streams first
    assert sim.where[4] is not drained             # the late request went elsewhere
    ended = max(r.e2e_s for i, r in enumerate(res.run.records) if sim.where[i] is drained)
    assert drained.gone_ns / 1e9 >= ended
    assert drained.core.has_work is False and drained.pool.num_free == drained.pool.num_blocks \
        - drained.pool.num_evictable + drained.pool.num_evictable


def test_a_burst_makes_the_leading_rule_scale_before_the_lagging_one():
    # a quiet second, then a burst of long prompts: admission's predicted queue jumps
    # with the first admitted prompts; the request rate rule waits for the rate
    quiet = [req(i, 0.5 * i, n_in=40, n_out=4) for i in range(4)]
    burst = [req(4 + i, 2.8 + 0.02 * i, n_in=800, n_out=4) for i in range(60)]
    reqs = quiet + burst
    prof = CostProfile(coef=[0.005, 0.0005, 0.0, 0.0, 0.0])     # 0.5 ms per token
    kw = {"cold_start_s": 1.0, "scale_interval_s": 1.0}

    def first_up(rule):
        sim, res = fleet(rule, reqs, profile=prof, **kw)
        return next(p.t_s for p in res.points if p.asked > 1), res

    rule = {"max_replicas": 6, "down_window_s": 60.0}
    t_lead, lead = first_up(Rule("headroom", 0.1, **rule))
    t_lag, lag = first_up(Rule("util", 0.7, **rule))
    assert t_lead < t_lag
    slo = 1.0

    def met(res):
        return sum(r.terminal == COMPLETED and r.ttft_s <= slo for r in res.run.records)
    assert met(lead) >= met(lag)     # a 1 s SLO: neither new replica is ready in time


def test_after_a_burst_the_headroom_rule_returns_to_the_floor_in_one_window():
    # a burst of long prompts, then quiet: once the window has seen only quiet intervals
    # the rule drops to what the quiet load needs, not one replica per window
    quiet = [req(i, 0.5 * i, n_in=40, n_out=4) for i in range(4)]
    burst = [req(4 + i, 2.0 + 0.05 * i, n_in=300, n_out=4) for i in range(40)]
    tail = [req(44 + i, 6.0 + 0.5 * i, n_in=40, n_out=4) for i in range(40)]
    prof = CostProfile(coef=[0.005, 0.0005, 0.0, 0.0, 0.0])     # 0.5 ms per token
    rule = Rule("headroom", 0.1, min_replicas=1, max_replicas=6, down_window_s=3.0)
    _, res = fleet(rule, quiet + burst + tail, profile=prof, cold_start_s=1.0,
                   scale_interval_s=1.0)
    assert max(p.asked for p in res.points) == 6
    # a replica that has not measured its prefill rate yet does not count as capacity 0
    assert all(p.signals.capacity_tps > 1000 for p in res.points if p.signals)
    downs = [(a.t_s, a.asked, b.asked) for a, b in
             zip(res.points, res.points[1:], strict=False) if b.asked < a.asked]
    assert downs[0][1] - downs[0][2] >= 4              # 6 -> 2 in one step, not 6 -> 5
    assert res.points[-1].asked == 1 and res.scale_downs == 2
    assert downs[-1][0] < 16.0                         # at the floor 10 s into the quiet
