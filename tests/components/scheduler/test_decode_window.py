"""What the load report tells admission of the live engine: the decode steps of the last
seconds (each class's time per output token, the decode batch's measured step and the cost
model's error on it), the cost model's decode rates, and the pool's free and evictable
blocks as the kv_manager last said, which it now says after frees alone too."""
from __future__ import annotations

from types import SimpleNamespace

import anyio
import msgspec
import pytest

from components.costs.cost_model import StepCostModel, decode_shape
from components.kv_manager.ops import apply_ops
from components.kv_manager.pool import BlockPool
from components.kv_manager.service import KvManagerService
from components.scheduler.decode_window import DecodeWindow, decode_classes
from components.scheduler.load import PoolCounts, load_report
from components.tenancy.fairness import VirtualCounters
from schemas.wire import AllocRequest, DecodeRates, FreeRequest, KvGrants, KvOps
from tests.components.scheduler.test_overlap import admitted, loop_of, result

S = 1_000_000_000


def test_each_class_sees_the_mean_of_the_steps_it_decoded_in():
    w = DecodeWindow(window_s=2.0)
    w.step(0, 0.10, 0.08, frozenset({"interactive"}))
    w.step(1 * S, 0.30, 0.24, frozenset({"interactive", "batch"}))
    w.step(1 * S, 0.50, 0.40, frozenset())               # decoded nothing: not kept
    w.step(2 * S - 1, 0.20, 0.16, frozenset({"batch"}))
    assert w.tpot_s() == pytest.approx({"interactive": 0.20, "batch": 0.25})
    assert w.measured_s() == pytest.approx(0.20)
    assert w.error() == 1.0                              # 3 steps: not yet told
    w.step(2 * S, 0.40, 0.32, frozenset({"batch"}))      # the first step expires
    assert w.steps == 3
    assert w.tpot_s() == pytest.approx({"interactive": 0.30, "batch": 0.30})
    assert w.measured_s() == pytest.approx(0.30)
    w.step(2 * S, 0.10, 0.08, frozenset({"batch"}))
    assert w.error() == pytest.approx(1.25)              # every step ran 1.25x its prediction


def test_the_error_is_taken_from_decode_only_steps():
    """Steps with a prefill chunk beside the decodes count for each class's TPOT (its
    streams wait for them) but not for measured ÷ predicted: four of them at 7x (a prompt's
    logprobs, priced as plain prefill) read as every decode step running 7x slow."""
    w = DecodeWindow(window_s=2.0)
    for i in range(4):
        w.step(i, 0.70, 0.10, frozenset({"interactive"}), pure=False)
    assert (w.error(), w.pure_steps, w.steps) == (1.0, 0, 4)
    for i in range(4):
        w.step(10 + i, 0.11, 0.10, frozenset({"interactive"}))
    assert w.error() == pytest.approx(1.1) and w.pure_steps == 4
    assert w.tpot_s() == pytest.approx({"interactive": (4 * 0.70 + 4 * 0.11) / 8})
    w.expire(2 * S + 5)                      # the mixed steps go first, then the rest
    assert (w.pure_steps, w.steps) == (4, 4)
    w.expire(2 * S + 20)
    assert (w.pure_steps, w.steps, w.error()) == (0, 0, 1.0)


def test_an_idle_spell_empties_the_window():
    w = DecodeWindow(window_s=2.0)
    for i in range(5):
        w.step(i * S // 10, 0.1, 0.1, frozenset({"interactive"}))
    w.expire(3 * S)
    assert (w.steps, w.tpot_s(), w.measured_s(), w.error()) == (0, {}, 0.0, 1.0)


def test_only_rows_computing_one_token_past_their_prompt_are_decodes():
    rows = [(1, 10, 10, "interactive"),     # the first decode after a 10-token prompt
            (1, 9, 10, "batch"),            # the prompt's last token: still prefill
            (16, 40, 10, "bulk"),           # a recompute chunk past the prompt
            (1, 30, 10, "interactive")]
    assert decode_classes(rows) == frozenset({"interactive"})


def test_decode_rates_sum_the_features_a_decode_step_moves_together():
    cost = StepCostModel(prior=[0.020, 0.0005, 1e-6, 0.0002, 2e-6])
    assert cost.decode_rates() == pytest.approx((0.020, 0.0007, 3e-6))
    base, per_seq, per_ctx = cost.decode_rates()
    assert cost.predict(decode_shape(7, 3000)) == pytest.approx(base + 7 * per_seq
                                                               + 3000 * per_ctx)
    assert StepCostModel().decode_rates() is None        # nothing measured, no prior


def deliver(loop, pool, msg, ms):
    """As test_overlap's, the kv_manager saying its free and evictable blocks."""
    plans, pending = [], [msg]
    while pending:
        for to, out in loop.handle(pending.pop(0), int(ms * 1e6), int(ms * 1e6)):
            if to == "executor":
                plans.append(out)
            elif to == "kv_manager" and isinstance(out, KvOps):
                pending.append(KvGrants(apply_ops(pool, out), pool.num_free, 0,
                                        pool.num_evictable))
    return plans


def test_the_loops_report_carries_the_classes_tpot_and_the_pool():
    loop, pool = loop_of(1)
    req = admitted("a", 10, max_tokens=5)
    req = msgspec.structs.replace(req, header=msgspec.structs.replace(
        req.header, granted_class="interactive"))
    plan, = deliver(loop, pool, req, 0.0)
    times = iter((10.0, 25.0, 45.0))                     # a prefill, then two decodes
    for token in (5, 6, 7):
        plan, = deliver(loop, pool, result(plan, {1: token}), next(times))
    load = loop.load(int(45.0 * 1e6))
    assert load.tpot_s == pytest.approx({"interactive": 0.0175})   # (15 + 20 ms) / 2
    assert load.decode_measured_s == pytest.approx(0.0175)
    assert load.running == 1 and load.running_context == 13      # 10 + 3 sampled
    assert (load.kv_free_blocks, load.kv_evictable_blocks) == (pool.num_free, 0)
    assert load.decode_rates is not None
    assert loop.load(int(2.1 * S)).tpot_s == {}                   # 2 s later: nothing


def test_a_report_without_a_window_or_pool_counts_says_so():
    core = SimpleNamespace(waiting=[], running=[], vtc=VirtualCounters({}),
                           _backlogged_tenants=set)
    load = load_report(core, StepCostModel(prior=[0.02, 0.001, 0.0, 0.0, 0.0]), 100)
    assert (load.kv_free_blocks, load.kv_evictable_blocks, load.tpot_s,
            load.decode_measured_s, load.decode_error) == (-1, -1, {}, 0.0, 1.0)
    assert load.decode_rates == DecodeRates(0.02, 0.001, 0.0)
    assert PoolCounts() == (-1, -1)


def test_the_kv_manager_answers_frees_alone_with_the_pools_counts():
    svc = KvManagerService.__new__(KvManagerService)     # the decision logic, no sockets
    svc.pool = BlockPool(8, 16, True, emit_events=False)
    svc.epoch, svc.stale_ops, svc.alloc_failures = 1, 0, 0
    sent = []

    class Sink:
        async def send(self, msg):
            sent.append(msg)

    svc.to_scheduler = Sink()
    hashes = [11, 12]
    anyio.run(svc._handle, KvOps(1, [], [AllocRequest(1, 3, "t", hashes, list(range(32)), 2)]))
    anyio.run(svc._handle, KvOps(1, [FreeRequest(1, 32)], []))     # no grant to send
    anyio.run(svc._handle, KvOps(0, [FreeRequest(1, 32)], []))     # stale: nothing done
    assert [(len(g.grants), g.free_blocks, g.evictable_blocks) for g in sent] == \
        [(1, 5, 0), (0, 8, 2)]          # its two full blocks are cached, and evictable
