"""Admission's ledger across a restart of admission: the scheduler hands back each held
request's entry (``Holding``), and the restarted ledger equals the one that admitted
them (per-tenant counts, running n, reserved blocks, per-class numbers), decides the next
request as that one would, and returns to zero exactly when each is released."""
from __future__ import annotations

import msgspec

from components.admission.decision import Kind
from components.scheduler.loop import SchedulerLoop
from schemas.wire import AdmissionMsg, HeldRequest, Holding, SchedulerLoad
from tests import messages as msgs
from tests.components.admission.policies import policy, req

TENANTS = [{"name": "a", "kv_blocks": 20, "max_running": 4}, {"name": "b"}]
LOAD = SchedulerLoad(1, 0, 200, 1000.0, 0.02)    # measured rates: predictions are set


def ledger(p) -> tuple:
    """Everything the ledger counts: its entries, reserved blocks, each tenant's requests,
    blocks and sequences, the sequences by class (zero counts dropped) and its stats."""
    led = p.ledger
    return (dict(led.entries), led.reserved_blocks,
            {t: (led.tenant_requests(t), led.tenant_blocks(t), led.tenant_seqs(t))
             for t in ("a", "b")},
            {c: k for c, k in led.class_seqs.items() if k}, led.stats())


EMPTY = ({}, 0, {"a": (0, 0, 0), "b": (0, 0, 0)}, {}, {})


def restarted(held_by: SchedulerLoop):
    """A new admission, given the scheduler's Holding as it crosses the bus."""
    (to, holding), = held_by.peer_restarted("admission", 0, 0)
    assert to == "admission"
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(holding), type=AdmissionMsg)
    assert isinstance(wire, Holding)
    fresh = policy(tenants=TENANTS)
    fresh.ttft.on_load(LOAD)
    fresh.holding(wire.requests)
    return fresh


def admit_four():
    """Four admitted requests, each handed to a scheduler as the service hands them
    (``Admitted.held``): n = 2, another class, a degraded one, one with a cached prefix."""
    p = policy(tenants=TENANTS)
    p.ttft.on_load(LOAD)
    loop = SchedulerLoop(p.config, epoch=1)
    asks = [(req("r1", "a", prompt=32, max_tokens=32, n=2), 0),       # 6 blocks, 2 seqs
            (req("r2", "a", prompt=64, max_tokens=32, cls="batch"), 0),   # 6 blocks
            (req("r3", "a", prompt=32, max_tokens=200, cls="batch"), 0),  # 15: degraded to 8
            (req("r4", "b", prompt=96, max_tokens=16, n=3), 64)]      # 32 uncached: 5 blocks
    kinds = []
    for r, cached in asks:
        d = p.decide(r, cached, 0.0)
        kinds.append(d.kind)
        params = msgspec.structs.replace(r.params, max_tokens=d.max_tokens)
        loop.handle(msgs.admitted(r.request_id, r.tenant, r.prompt_token_ids, r.block_hashes,
                             params, 1, service_class=d.service_class,
                             held=p.ledger.entry(r.request_id)), 0, 0)
    assert kinds == [Kind.ACCEPT, Kind.ACCEPT, Kind.DEGRADE, Kind.ACCEPT]
    return p, loop


def test_a_restarted_ledger_equals_the_one_that_admitted():
    p, loop = admit_four()
    assert (p.ledger.reserved_blocks, p.ledger.tenant_blocks("a"), p.ledger.tenant_seqs("a"),
            p.ledger.tenant_seqs("b")) == (25, 20, 4, 3)
    fresh = restarted(loop)
    assert ledger(fresh) == ledger(p)
    assert fresh.ledger.stats() == {
        "ledger.outstanding.a": 3, "ledger.kv_blocks.a": 20, "ledger.seqs.a": 4,
        "ledger.outstanding.b": 1, "ledger.kv_blocks.b": 5, "ledger.seqs.b": 3,
        "ledger.class_outstanding.interactive": 2, "ledger.class_kv_blocks.interactive": 11,
        "ledger.class_outstanding.batch": 2, "ledger.class_kv_blocks.batch": 14}
    assert fresh.stats()["reserved_kv_blocks"] == 25
    # the tenant's caps hold the next request on both alike: its n (4 running, the cap)
    # and its KV budget (20 of 20), not the one-sequence, no-block count it used to get
    for who in (p, fresh):
        d = who.decide(req("next", "a", prompt=16, max_tokens=16), 0, 0.0)
        assert (d.kind, d.reason) == (Kind.QUEUE, "waiting_for_tenant_running")
        assert who.cancel("next")


def test_released_after_a_restart_returns_the_ledger_to_zero_exactly():
    p, loop = admit_four()
    fresh = restarted(loop)
    ids = ["r1", "r2", "r3", "r4"]
    ttft = {rid: 0.5 for rid in ids}
    for who in (p, fresh):
        who.released(ids[:2], 1.0, {}, ttft)
        assert who.ledger.reserved_blocks == 13 and who.ledger.tenant_seqs("a") == 1
        who.released(ids[2:] + ids, 2.0, {}, ttft)       # a repeat subtracts nothing
        assert ledger(who) == EMPTY                      # every count exactly 0, none below
    # each entry's predicted TTFT came back with it: the restart learned the same bias
    assert fresh.ttft.learned_s == p.ttft.learned_s > 0


def test_a_request_replayed_before_the_holding_keeps_its_new_entry():
    """The streamer may replay a request to the new admission before the scheduler's
    Holding arrives: it is decided again, and its Released subtracts that entry."""
    p, loop = admit_four()
    fresh = policy(tenants=TENANTS)
    fresh.ttft.on_load(LOAD)
    assert fresh.decide(req("r3", "a", prompt=32, max_tokens=40, cls="batch"), 0, 0.0).kind \
        == Kind.ACCEPT                                          # 5 blocks, not the 8 it had
    (_, holding), = loop.peer_restarted("admission", 0, 0)
    fresh.holding(holding.requests)
    assert fresh.ledger.entry("r3").kv_blocks == 5
    assert fresh.ledger.reserved_blocks == 25 - 8 + 5
    fresh.released(["r1", "r2", "r3", "r4"], 1.0)
    assert ledger(fresh) == EMPTY


def test_a_request_admitted_without_an_entry_counts_its_tenant_and_n():
    """The simulator's and older tests' Admitted carry no entry: the scheduler still
    reports the tenant and n, with no blocks."""
    p = policy(tenants=TENANTS)
    loop = SchedulerLoop(p.config, epoch=1)
    r = req("x", "b", n=2)
    loop.handle(msgs.admitted(r.request_id, r.tenant, r.prompt_token_ids, r.block_hashes,
                         r.params, 1), 0, 0)
    (_, holding), = loop.peer_restarted("admission", 0, 0)
    assert holding.requests == [HeldRequest("x", "b", "", 2, 0)]
