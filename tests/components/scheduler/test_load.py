"""The scheduler's load report to admission: the backlog, and per tenant its virtual counter
and its waiting and in-progress prefill, each split by the class it ranks with (aged) and
the waiting part back from preemption apart, so admission can price a request where the
fair order would start it; and its wire form, which still decodes from a scheduler that
predates either split."""
from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from bus.codec import Codec, encode
from components.costs.cost_model import StepCostModel
from components.scheduler.load import load_report
from components.scheduler.sequence import Seq
from components.tenancy.fairness import VirtualCounters
from schemas.wire import AdmissionMsg, DecodeRates, SchedulerLoad, TenantBacklog


def seq(tenant: str, remaining: int, num_tokens: int = 0, rid: str = "",
        arrival_ns: int = 0, first_token_ns: int = 0, priority: int = 0,
        aging_per_s: float = 0.0, resumes: bool = False) -> SimpleNamespace:
    s = SimpleNamespace(tenant=tenant, remaining=remaining, num_tokens=num_tokens,
                        num_computed=max(num_tokens - remaining, 0), request_id=rid,
                        arrival_ns=arrival_ns, first_token_ns=first_token_ns,
                        priority=priority, aging_per_s=aging_per_s, resumes=resumes,
                        deterministic=False)
    s.aged_priority = lambda now_ns: Seq.aged_priority(s, now_ns)
    return s


FLAT = StepCostModel(prior=[0.5, 0.0, 0.0, 0.0, 0.0])     # every step 0.5 s


def test_load_report_splits_the_backlog_by_tenant():
    vtc = VirtualCounters({"a": 1.0, "b": 2.0})
    vtc.charge("a", 900)
    vtc.charge("b", 100)                             # ÷ its weight: 50
    vtc.charge("c", 10)                              # nothing waiting or running
    core = SimpleNamespace(
        waiting=[seq("a", 300), seq("b", 40), seq("a", 500)],
        running=[seq("a", 200, 400), seq("b", 1, 90)],   # a mid-prefill, b decoding
        vtc=vtc, _backlogged_tenants=lambda: {"a", "b"})
    assert load_report(core, FLAT, 1000) == SchedulerLoad(
        2, 3, 300 + 40 + 500 + 200, 2000.0, 0.5, {
            "a": TenantBacklog(900.0, True, 800, 200, 0, {0: 800}, {0: 200}),
            "b": TenantBacklog(50.0, True, 40, 0, 0, {0: 40}),
            "c": TenantBacklog(10.0, False, 0, 0)},
        # 300·301/2 + 40·41/2 + 500·501/2, and a's 200 left after 200 computed
        queued_prefill_pairs=45150 + 820 + 125250 + (200 * 200 + 20100),
        running_context=400 + 90, decode_rates=DecodeRates(0.5, 0.0, 0.0))


def test_load_report_splits_each_tenants_backlog_by_the_class_it_ranks_with():
    """At 90 s: a's batch (priority 1, a unit a minute) waiting since 0 ranks as class 0,
    its batch from 40 s still as 1, its interactive prompt in progress as 0 and its batch
    in progress since 40 s as 1; b's sequence back from preemption is counted apart (it
    starts before any fresh work), its fresh batch by class."""
    S = 1_000_000_000
    core = SimpleNamespace(
        waiting=[seq("a", 300, priority=1, aging_per_s=1 / 60),
                 seq("a", 500, priority=1, aging_per_s=1 / 60, arrival_ns=40 * S),
                 seq("b", 64, priority=1, resumes=True),
                 seq("b", 100, priority=1, aging_per_s=1 / 60, arrival_ns=80 * S)],
        running=[seq("a", 200, 400), seq("a", 700, 900, priority=1, aging_per_s=1 / 60,
                                           arrival_ns=40 * S)],
        vtc=VirtualCounters({}), _backlogged_tenants=lambda: {"a", "b"})
    load = load_report(core, FLAT, 1000, 90 * S)
    assert load.tenants == {"a": TenantBacklog(0.0, True, 800, 900, 0, {0: 300, 1: 500},
                                               {0: 200, 1: 700}),
                            "b": TenantBacklog(0.0, True, 164, 0, 64, {1: 100})}
    assert load_report(core, FLAT, 1000).tenants["a"].queued_by_class == {1: 800}  # no clock


def test_load_report_prices_prefill_tokens_and_attention_apart():
    """A full chunk's rate without its attention (1000 tokens: 20 ms + 1000 x 0.5 ms), the
    attention per pair (1 µs), a decode step of the running batch (2 sequences reading
    400 + 90 positions: 20 ms + 2 x (0.5 + 0.2) ms + 490 x (1 + 2) µs), and the pairs of
    the prefill the running sequence has left (200 after 200: 200·200 + 200·201/2)."""
    core = SimpleNamespace(waiting=[], running=[seq("a", 200, 400), seq("b", 1, 90)],
                           vtc=VirtualCounters({}), _backlogged_tenants=set)
    cost = StepCostModel(prior=[0.020, 0.0005, 1e-6, 0.0002, 2e-6])
    load = load_report(core, cost, 1000)
    assert load.prefill_tokens_per_s == pytest.approx(1000 / (0.020 + 0.5 + 0.0002 + 0.002))
    assert load.attention_s_per_pair == 1e-6
    assert load.decode_step_s == pytest.approx(0.020 + 2 * 0.0007 + 490 * 3e-6)
    assert load.queued_prefill_tokens == 200
    assert load.queued_prefill_pairs == 200 * 200 + 200 * 201 // 2


def test_load_report_lists_how_long_requests_without_a_first_token_have_waited():
    core = SimpleNamespace(
        waiting=[seq("a", 300, rid="w", arrival_ns=2_000_000_000),
                 seq("a", 40, rid="preempted", arrival_ns=1_000_000_000,
                     first_token_ns=1_500_000_000)],            # it had its first token
        running=[seq("a", 200, 400, rid="prefilling", arrival_ns=1_000_000_000),
                 seq("a", 1, 90, rid="decoding", arrival_ns=0, first_token_ns=500)],
        vtc=VirtualCounters({}), _backlogged_tenants=set)
    assert load_report(core, FLAT, 1000).awaiting_first_s == {}      # no clock: not listed
    assert load_report(core, FLAT, 1000, 3_250_000_000).awaiting_first_s == {
        "prefilling": 2.25, "w": 1.25}


def test_a_load_report_without_tenants_still_decodes():
    class OldLoad(msgspec.Struct, tag="scheduler_load", frozen=True):
        running: int
        waiting: int
        queued_prefill_tokens: int
        prefill_tokens_per_s: float
        decode_step_s: float

    codec = Codec(AdmissionMsg)
    assert codec.decode(encode(OldLoad(1, 2, 300, 1000.0, 0.05))).body == \
        SchedulerLoad(1, 2, 300, 1000.0, 0.05)
    new = SchedulerLoad(1, 2, 300, 1000.0, 0.05, {"a": TenantBacklog(5.5, True, 300, 200)})
    assert codec.decode(encode(new)).body == new
    assert codec.malformed == 0


def test_a_tenant_backlog_without_the_class_split_still_decodes_and_the_other_way():
    class OldBacklog(msgspec.Struct, frozen=True, array_like=True):
        counter: float
        backlogged: bool = False
        queued_prefill_tokens: int = 0
        running_prefill_tokens: int = 0

    new = TenantBacklog(5.5, True, 300, 200, 64, {0: 36, 1: 200}, {1: 200})
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(OldBacklog(5.5, True, 300, 200)),
                                  type=TenantBacklog) == TenantBacklog(5.5, True, 300, 200)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldBacklog) == \
        OldBacklog(5.5, True, 300, 200)                  # an older admission reads the totals
    codec = Codec(AdmissionMsg)
    load = SchedulerLoad(1, 2, 500, 1000.0, 0.05, {"a": new})
    assert codec.decode(encode(load)).body == load and codec.malformed == 0


def test_backlog_tokens_counts_prefill_left_and_the_most_each_choice_may_still_sample():
    """The autoscaler's backlog (the router exports it): every sequence's prompt left to
    compute, waiting or running; and the output it may still sample, up to its
    max_tokens, else up to max_model_len, once per choice of an n > 1 request not yet
    forked."""
    from components.scheduler.load import backlog_tokens

    def s(remaining, num_tokens, num_output, max_tokens=None, slots=1):
        return SimpleNamespace(remaining=remaining, num_tokens=num_tokens,
                               num_output=num_output, slots=slots,
                               params=SimpleNamespace(max_tokens=max_tokens))

    core = SimpleNamespace(max_model_len=1000, waiting=[
        s(300, 300, 0, max_tokens=50),                 # fresh: 300 to prefill, 50 to sample
        s(100, 100, 0, max_tokens=20, slots=3),        # n = 3, unforked: 3 x 20
    ], running=[
        s(1, 410, 10, max_tokens=40),                  # decoding: 30 left
        s(0, 900, 0),                                  # no max_tokens: 100 left of the context
        s(1, 1000, 5, max_tokens=500),                 # at max_model_len: none
    ])
    assert backlog_tokens(core) == {"backlog.prefill_tokens": 300 + 100 + 1 + 0 + 1,
                                    "backlog.decode_tokens": 50 + 60 + 30 + 100 + 0}
    assert backlog_tokens(SimpleNamespace(max_model_len=8, waiting=[], running=[])) == {
        "backlog.prefill_tokens": 0, "backlog.decode_tokens": 0}
