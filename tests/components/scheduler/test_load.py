"""The scheduler's load report to admission: the backlog, and per tenant its virtual counter
and its waiting and in-progress prefill, so admission can price a request where VTC would
start it; and its wire form, which still decodes from a scheduler that predates the split."""
from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from bus.codec import Codec, encode
from components.scheduler.cost_model import StepCostModel
from components.scheduler.fairness import VirtualCounters
from components.scheduler.load import load_report
from schemas.wire import AdmissionMsg, DecodeRates, SchedulerLoad, TenantBacklog


def seq(tenant: str, remaining: int, num_tokens: int = 0, rid: str = "",
        arrival_ns: int = 0, first_token_ns: int = 0) -> SimpleNamespace:
    return SimpleNamespace(tenant=tenant, remaining=remaining, num_tokens=num_tokens,
                           num_computed=max(num_tokens - remaining, 0), request_id=rid,
                           arrival_ns=arrival_ns, first_token_ns=first_token_ns)


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
            "a": TenantBacklog(900.0, True, 800, 200),
            "b": TenantBacklog(50.0, True, 40, 0),
            "c": TenantBacklog(10.0, False, 0, 0)},
        # 300·301/2 + 40·41/2 + 500·501/2, and a's 200 left after 200 computed
        queued_prefill_pairs=45150 + 820 + 125250 + (200 * 200 + 20100),
        running_context=400 + 90, decode_rates=DecodeRates(0.5, 0.0, 0.0))


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
