"""The end-to-end bound as admission decides it, exact: the tighter of the client's
``e2e_deadline_ms`` and its class's ``e2e_slo_ms`` (a client may tighten its class's bound,
never loosen it) goes to the scheduler (``Admitted``), the streamer (``Accepted``) and the
decision's span; under the deadline policy a first token predicted past it is
``deadline_unmeetable``, and a queued request expires at it."""
from __future__ import annotations

import anyio
import msgspec
import pytest

from components.admission.decision import Kind
from schemas.config import SLO_CLASSES, AdmissionConfig, ConfigError, ServiceClass
from schemas.wire import Accepted, Admitted, SchedulerLoad, deadline_ns
from tests.components.admission.policies import CLASSES, policy, req, traced_service

BOUNDED = [{**CLASSES[0], "e2e_slo_ms": 5000}, CLASSES[1], CLASSES[2]]


def bounded(rid="r", e2e=None, **kw):
    r = req(rid, **kw)
    return msgspec.structs.replace(r, header=msgspec.structs.replace(
        r.header, e2e_deadline_ns=deadline_ns(r.header.arrival_ns, e2e)))


@pytest.mark.parametrize("class_ms, client_ms, expect", [
    (5000, None, 5000),          # the class's bound
    (5000, 8000, 5000),          # looser than the class's: clamped to it
    (5000, 2000, 2000),          # tighter: the client's
    (None, 3000, 3000),          # a class with none: the client's own
    (None, None, None),          # neither: no bound
])
def test_the_bound_is_the_tighter_of_the_clients_and_its_classs(class_ms, client_ms, expect):
    classes = [{**CLASSES[0], "e2e_slo_ms": class_ms}, *CLASSES[1:]] if class_ms else CLASSES
    for kind in ("deadline", "fcfs"):                  # either policy
        p = policy(kind, classes=classes)
        r = bounded(e2e=client_ms)
        d = p.decide(r, 0, 0.0)
        assert d.kind == Kind.ACCEPT and d.estimate.e2e_deadline_ms == expect
        assert p.admitted(r, d).header.e2e_deadline_ms == expect


def test_a_first_token_predicted_past_the_bound_is_refused_at_once():
    p = policy()
    p.ttft.load = SchedulerLoad(4, 2, 4000, 1000.0, 0.05)    # 4 s of prefill queued
    d = p.decide(bounded("short", e2e=3000, cls="batch"), 0, 0.0)   # batch: no TTFT target
    assert (d.kind, d.reason) == (Kind.REJECT, "deadline_unmeetable")
    assert "end-to-end deadline 3000 ms" in d.rejected.message
    assert d.rejected.retry_after_s == pytest.approx(4.082 - 3.0, abs=0.1)
    assert p.decide(bounded("long", e2e=10_000, cls="batch"), 0, 0.0).kind == Kind.ACCEPT


def test_a_queued_request_expires_at_its_bound():
    p = policy(num_blocks=4)
    p.decide(req("fill", prompt=32, max_tokens=32), 0, 0.0)          # the pool is full
    d = p.decide(bounded("q", e2e=300, cls="batch", prompt=32, max_tokens=32), 0, 0.0)
    assert d.kind == Kind.QUEUE                                            # max_queue_ms 60 s
    assert p.expire(0.29) == []
    (gone,) = p.expire(0.3)
    assert (gone.request_id, gone.reason) == ("q", "deadline_expired")


def test_the_bound_is_on_the_decision_span_and_in_accepted(monkeypatch):
    svc, exporter, sent = traced_service(monkeypatch, policy(classes=BOUNDED))
    anyio.run(svc._admit, bounded("loose", e2e=9000), None, 0)
    anyio.run(svc._admit, bounded("none"), None, 0)
    loose, none = (s.attributes for s in exporter.get_finished_spans())
    assert (loose["weir.admission.e2e_deadline_ms"], loose["weir.request.e2e_deadline_ms"]) \
        == (5000, 9000)
    assert (none["weir.admission.e2e_deadline_ms"], none["weir.request.e2e_deadline_ms"]) \
        == (5000, -1)
    admitted = [m for m in sent if isinstance(m, Admitted)]
    accepted = [e for m in sent if not isinstance(m, Admitted) for e in m.events]
    assert [m.header.e2e_deadline_ns for m in admitted] == [5_000_000_000] * 2   # arrival 0
    assert all(isinstance(a, Accepted) and a.e2e_deadline_ms == 5000 for a in accepted)
    unbounded = policy()
    svc.policy, sent[:] = unbounded, []
    anyio.run(svc._admit, bounded("free"), None, 0)
    assert exporter.get_finished_spans()[-1].attributes["weir.admission.e2e_deadline_ms"] == -1
    assert sent[-1].events[0].e2e_deadline_ms is None


def test_the_class_bound_is_validated_shown_and_the_shipped_classes_have_none():
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="e2e_slo_ms must be > 0"):
            ServiceClass("x", e2e_slo_ms=bad)
    assert ServiceClass("x", e2e_slo_ms=0.5).e2e_slo_ms == 0.5
    assert [c.e2e_slo_ms for c in SLO_CLASSES] == [None, None]
    bounded_cfg = AdmissionConfig(classes=(ServiceClass("i", ttft_slo_ms=3000, e2e_slo_ms=2e4),))
    assert "i (TTFT 3000 ms, no queue, drops late work, ends at 20000 ms)" in \
        bounded_cfg.describe()
    assert "ends at" not in AdmissionConfig().describe()
