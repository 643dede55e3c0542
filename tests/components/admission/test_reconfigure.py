"""A live config change in admission (``AdmissionPolicy.reconfigure``): the next decision
is the new policy's; what was decided stands, and per-tenant state carries over by name."""
from __future__ import annotations

import msgspec

from components.admission.decision import Kind
from schemas.config_change import candidate
from tests.components.admission.policies import policy, req


def _apply(p, toml: str) -> None:
    p.reconfigure(candidate(p.config, toml))


def test_the_next_decision_is_the_new_policys_and_admitted_requests_stay():
    p = policy(tenants=[{"name": "a"}, {"name": "b"}])
    first = p.decide(req("r1"), 0, 0.0)
    assert (first.kind, first.service_class) == (Kind.ACCEPT, "interactive")
    blocks = p.ledger.reserved_blocks
    _apply(p, '[admission]\npolicy = "fcfs"\n[[admission.tenants]]\nname = "a"\n'
              'max_outstanding = 1\n[[admission.tenants]]\nname = "b"\n')
    assert p.kind == p.rule.config.admission.policy == "fcfs"
    assert "r1" in p.ledger and p.ledger.reserved_blocks == blocks      # not re-decided
    second = p.decide(req("r2"), 0, 1.0)                                 # a's new cap
    assert (second.kind, second.reason) == (Kind.REJECT, "tenant_over_budget")
    assert p.decide(req("r3", tenant="b"), 0, 1.0).kind == Kind.ACCEPT
    p.released(["r1", "r3"], 2.0, {"r1": 4, "r3": 4}, {"r1": 0.1, "r3": 0.1})
    assert len(p.ledger) == 0 and p.ledger.reserved_blocks == 0          # exact after drain


def test_token_buckets_carry_their_level_by_tenant_name():
    p = policy(tenants=[{"name": "a", "token_rate": 100.0, "token_burst": 1000.0},
                        {"name": "b", "token_rate": 10.0}])
    assert p.decide(req("r1", prompt=320, max_tokens=32), 0, 0.0).kind == Kind.ACCEPT
    level = p.token_bucket("a").level
    assert level < 1000.0
    _apply(p, '[[admission.tenants]]\nname = "a"\ntoken_rate = 50.0\ntoken_burst = 2000.0\n'
              '[[admission.tenants]]\nname = "b"\n')
    a = p.token_bucket("a")
    assert (a.rate, a.burst, a.level) == (50.0, 2000.0, level)          # carried, not refilled
    _apply(p, '[[admission.tenants]]\nname = "a"\ntoken_rate = 50.0\ntoken_burst = 100.0\n'
              '[[admission.tenants]]\nname = "b"\n')
    assert p.token_bucket("a").level == min(level, 100.0)                # cut to the new burst
    _apply(p, '[[admission.tenants]]\nname = "a"\n[[admission.tenants]]\nname = "b"\n')
    assert p.token_bucket("a") is None                                   # no rate: no bucket


def test_virtual_counters_carry_over_with_the_new_weights():
    p = policy(tenants=[{"name": "a"}, {"name": "b"}])
    p.vtc.charge("a", input_tokens=100)
    _apply(p, '[[admission.tenants]]\nname = "a"\nweight = 4.0\n'
              '[[admission.tenants]]\nname = "b"\n')
    assert p.vtc.of("a") == 100.0 and p.vtc.weight("a") == 4.0
    p.vtc.charge("a", input_tokens=100)
    assert p.vtc.of("a") == 125.0


def test_a_queued_request_keeps_the_decision_it_was_queued_with():
    p = policy(num_blocks=8)
    big = p.decide(req("big", prompt=96, max_tokens=16), 0, 0.0)
    assert big.kind == Kind.ACCEPT
    queued = p.decide(req("q", cls="batch", prompt=64, max_tokens=16), 0, 0.0)
    assert queued.kind == Kind.QUEUE
    classes = [dict(c, priority=c["priority"] + 1) for c in
               msgspec.to_builtins(p.config.admission.classes)]
    toml = "".join("[[admission.classes]]\n" + "".join(
        f"{k} = {msgspec.json.encode(v).decode()}\n" for k, v in c.items() if v is not None)
        for c in classes)
    _apply(p, toml)
    assert p.classes["batch"].priority == 11
    p.released(["big"], 0.1, {"big": 16}, {"big": 0.05})
    out = p.release(0.1)
    assert [(r.request_id, d.service_class, d.priority) for r, d, _ in out] == \
        [("q", "batch", queued.priority)]


def test_the_decision_span_carries_the_version_that_made_it(monkeypatch):
    import anyio

    from schemas.config_change import PolicySections
    from schemas.wire import PolicyChange
    from tests.components.admission.policies import traced_service

    svc, exporter, _ = traced_service(monkeypatch, policy())
    anyio.run(svc._admit, req("before"), None, 0)
    new = candidate(svc.config, '[admission]\npolicy = "fcfs"\n')
    svc.apply_policy(PolicyChange(7, "ab" * 32, PolicySections.of(new)))
    anyio.run(svc._admit, req("after"), None, 0)
    spans = [(s.attributes["weir.request_id"], s.attributes["weir.config.version"],
              s.attributes["weir.admission.policy"]) for s in exporter.get_finished_spans()]
    assert spans == [("before", 0, "deadline"), ("after", 7, "fcfs")]
    assert svc.info()["config_version"] == "7" and svc.stats()["config_version"] == 7
