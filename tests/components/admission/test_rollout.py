"""A candidate beside the policy in force (``components/admission/rollout.py``): a shadow
decides every request and changes nothing; a canary decides, and is enforced, for its
tenants (share 0.5 takes "b", at 0.24, and not "a", at 0.79)."""
from __future__ import annotations

import anyio

from components.admission.decision import Kind
from components.tenancy.canary import in_canary
from schemas.config_change import PolicySections, candidate
from schemas.wire import PolicyChange, PolicyTrial
from tests.components.admission.policies import policy, req, traced_service

FCFS_SHADOW = '[admission]\npolicy = "fcfs"\n[rollout]\nmode = "shadow"\n'


def test_the_tenants_of_a_half_share():
    assert in_canary("b", 0.5) and not in_canary("a", 0.5)


def test_a_shadow_decides_beside_and_changes_nothing():
    p = policy(num_blocks=8)
    p.try_candidate(candidate(p.config, FCFS_SHADOW), 3, "ab" * 32)
    trial = p.trial
    assert trial is not None and trial.mode == "shadow" and not trial.takes("b")
    big = req("big", prompt=96, max_tokens=16)
    shadow = trial.shadow(big, 0, 0.0)
    assert (shadow.kind, shadow.reason) == (Kind.ACCEPT, "within_caps")
    assert len(p.ledger) == 0 and p.queued == 0 and not p.decisions     # nothing changed
    live = p.decide(big, 0, 0.0)
    trial.compare(shadow, live)
    second = req("q", cls="batch", prompt=64, max_tokens=16)
    shadow2 = trial.shadow(second, 0, 0.0)
    live2 = p.decide(second, 0, 0.0)
    trial.compare(shadow2, live2)
    assert (live2.kind, shadow2.kind) == (Kind.QUEUE, Kind.ACCEPT)
    assert p.stats()["shadow.decisions"] == 2
    stats = {k: v for k, v in p.stats().items() if k.startswith(("shadow.", "rollout."))}
    assert stats == {"rollout.version": 3, "rollout.shadow": True, "rollout.canary_share": 0.0,
                     "shadow.decisions": 2, "shadow.disagreements": 1,
                     "shadow.accept.within_caps": 2, "shadow.disagree.queue.accept": 1}
    assert p.ledger.reserved_blocks == live.estimate.kv_blocks          # the live one's only


def test_the_shadow_decision_is_on_the_span_and_nothing_is_enforced(monkeypatch):
    svc, exporter, _ = traced_service(monkeypatch, policy(num_blocks=8))
    svc.traceparents, svc._wake_queue = {}, anyio.Event()        # a queued request's
    settled = PolicySections.of(svc.config)
    cand = candidate(svc.config, FCFS_SHADOW)
    svc.apply_policy(PolicyChange(0, "00" * 32, settled,
                                  PolicyTrial(5, "ab" * 32, PolicySections.of(cand))))
    anyio.run(svc._admit, req("big", prompt=96, max_tokens=16), None, 0)
    anyio.run(svc._admit, req("q", cls="batch", prompt=64, max_tokens=16), None, 0)
    spans = [s for s in exporter.get_finished_spans() if s.name == "admission.decide"]
    got = [(s.attributes["weir.admission.decision"], s.attributes["weir.shadow.decision"],
            s.attributes["weir.shadow.reason"], s.attributes["weir.shadow.agrees"],
            s.attributes["weir.config.version"], s.attributes["weir.rollout.version"])
           for s in spans]
    assert got == [("accept", "accept", "within_caps", True, 0, 5),
                   ("queue", "accept", "within_caps", False, 0, 5)]
    assert svc.policy.queued == 1                                      # the live decision
    rollout = [s for s in exporter.get_finished_spans() if s.name == "admission.rollout"]
    assert rollout[0].attributes["weir.rollout.mode"] == "shadow"


def test_a_canary_decides_for_its_tenants_into_the_one_ledger():
    p = policy(tenants=[{"name": "a"}, {"name": "b"}])
    cand = candidate(p.config, '[admission]\npolicy = "fcfs"\n[[admission.tenants]]\n'
                               'name = "a"\n[[admission.tenants]]\nname = "b"\n'
                               'max_outstanding = 1\n[rollout]\nmode = "canary"\n'
                               'share = 0.5\n')
    p.try_candidate(cand, 4, "cd" * 32)
    da = p.decide(req("a1"), 0, 0.0)
    db = p.decide(req("b1", tenant="b"), 0, 0.0)
    db2 = p.decide(req("b2", tenant="b"), 0, 0.0)
    assert [(d.kind, d.reason) for d in (da, db, db2)] == [
        (Kind.ACCEPT, "fits"), (Kind.ACCEPT, "within_caps"), (Kind.REJECT, "tenant_over_budget")]
    assert "a1" in p.ledger and "b1" in p.ledger and len(p.ledger) == 2
    assert p.ledger.reserved_blocks == da.estimate.kv_blocks           # fcfs reserves none
    assert p.admitted(req("b1", tenant="b"), db).drop_late is False     # the candidate's
    assert p.admitted(req("a1"), da).drop_late is True                  # the settled one's
    assert p.decisions[Kind.ACCEPT, "interactive"] == 2
    p.released(["a1", "b1"], 1.0, {"a1": 4, "b1": 4}, {"a1": 0.1, "b1": 0.1})
    assert len(p.ledger) == 0 and p.ledger.reserved_blocks == 0


def test_a_canary_tenants_bucket_runs_at_the_candidates_rate():
    p = policy(tenants=[{"name": "a", "token_rate": 100.0}, {"name": "b", "token_rate": 100.0}])
    cand = candidate(p.config, '[[admission.tenants]]\nname = "a"\ntoken_rate = 50.0\n'
                               '[[admission.tenants]]\nname = "b"\ntoken_rate = 50.0\n'
                               '[rollout]\nmode = "canary"\nshare = 0.5\n')
    p.decide(req("a1"), 0, 0.0)
    p.decide(req("b1", tenant="b"), 0, 0.0)
    p.try_candidate(cand, 1, "ef" * 32)
    assert (p.token_bucket("a").rate, p.token_bucket("b").rate) == (100.0, 50.0)
    p.try_candidate(None)                                               # rolled back
    assert (p.token_bucket("a").rate, p.token_bucket("b").rate) == (100.0, 100.0)


def test_a_canary_queued_request_is_released_and_keeps_its_class_after_a_rollback():
    p = policy(num_blocks=8)
    cand = candidate(p.config, '[admission]\nttft_headroom = 0.5\n[rollout]\nmode = "canary"\n'
                               'share = 0.5\n')
    p.try_candidate(cand, 1, "ef" * 32)
    big = p.decide(req("big", prompt=96, max_tokens=16), 0, 0.0)
    queued = p.decide(req("q", tenant="b", cls="batch", prompt=64, max_tokens=16), 0, 0.0)
    assert (big.kind, queued.kind) == (Kind.ACCEPT, Kind.QUEUE)
    p.try_candidate(None)
    p.released(["big"], 0.1, {"big": 16}, {"big": 0.05})
    out = p.release(0.1)
    assert [(r.request_id, d.service_class, d.priority) for r, d, _ in out] == \
        [("q", "batch", queued.priority)]
    assert "q" in p.ledger
