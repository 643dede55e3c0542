"""The streamer's request registry, built directly: exactly one terminal per request (a
second terminal is dropped and counted, as is any event after the terminal, and the
engine is asked once per id to stop such work), what each tenant holds, and the late
backstop's due times and ends, to the microsecond."""
from __future__ import annotations

import pytest

from components.streamer.registry import (
    LATE_GRACE_S,
    ORPHANS_KEPT,
    Active,
    Registry,
    cut_at_deadline,
)
from components.streamer.slo import RequestClock
from schemas.wire import (
    Accepted,
    Cancelled,
    ChoiceEnd,
    Failed,
    Finished,
    Rejected,
    SamplingParams,
    TextDelta,
    Usage,
)
from tests import messages as msgs

T0 = 100.0


def request(tenant="t", n=1, started=T0) -> Active:
    req = Active(b"client", tenant, 0, RequestClock(started, None, "interactive"))
    req.pending = msgs.new_request("x", tenant, "hi", None, SamplingParams(n=n), 0)
    return req


@pytest.mark.parametrize("terminal", [
    Finished("r", "stop", Usage(1, 1, 0)), Rejected("r", "overloaded", ""),
    Cancelled("r", "cancelled by client"), Failed("r", "lost")])
def test_the_engines_terminal_closes_a_request_and_a_second_is_dropped(terminal):
    reg = Registry()
    req = request()
    reg.open("r", req)
    assert reg.event(TextDelta("r", "a", (1,), 0)) is req and "r" in reg
    assert reg.event(terminal) is req               # delivered: the one terminal
    assert "r" not in reg and len(reg) == 0 and reg.held_by("t") == 0
    assert reg.event(Finished("r", "stop", Usage(1, 1, 0))) is None     # a second
    assert reg.event(Failed("r", "late")) is None                       # a third
    assert reg.event(TextDelta("r", "b", (2,), 0)) is None              # after it
    assert reg.late_events == 3


def test_a_terminal_the_streamer_decided_drops_the_engines():
    reg = Registry()
    req = request()
    reg.open("r", req)
    assert reg.close("r") is req                    # e.g. the client cancelled
    assert reg.event(Cancelled("r", "cancelled")) is None
    assert reg.late_events == 1
    with pytest.raises(KeyError):
        reg.close("r")                              # never two terminals from here either


def test_work_after_the_terminal_is_stopped_once_per_id():
    reg = Registry()
    assert reg.event(TextDelta("ghost", "a", (1,), 0)) is None
    assert reg.orphaned("ghost") and not reg.orphaned("ghost")
    assert reg.orphans_cancelled == 1
    for i in range(ORPHANS_KEPT):
        reg.orphaned(f"o{i}")
    assert reg.orphaned("ghost")                    # forgotten past ORPHANS_KEPT
    assert reg.orphans_cancelled == ORPHANS_KEPT + 2


def test_what_each_tenant_holds_leaves_no_trail():
    reg = Registry()
    reg.open("a1", request("a"))
    reg.open("a2", request("a"))
    reg.open("b1", request("b"))
    assert (reg.held_by("a"), reg.held_by("b"), len(reg)) == (2, 1, 3)
    reg.close("b1")
    reg.event(Finished("a1", "stop", Usage(1, 1, 0)))
    assert (reg.held_by("a"), reg.held_by("b")) == (1, 0)
    reg.close("a2")
    assert reg._per_tenant == {}                    # a claimed tenant name is not kept
    assert reg.requests() == []


def test_requests_is_a_copy_the_caller_may_close_from():
    reg = Registry()
    reg.open("a", request())
    reg.open("b", request())
    for rid, _ in reg.requests():
        reg.close(rid)
    assert len(reg) == 0


def test_the_backstop_ends_what_the_engine_did_not_at_its_bounds_plus_grace():
    reg = Registry()
    for rid, n in (("waiting", 1), ("decoding", 2), ("early", 1), ("done", 1)):
        reg.open(rid, request(n=n))
    for rid in ("waiting", "decoding", "done"):
        req = reg.get(rid)
        reg.accepted(rid, req, Accepted(rid, 5, 1, "interactive", e2e_deadline_ms=1000))
        assert req.pending is None and req.accepted is not None
    early = reg.get("early")                # a class that drops late work: TTFT 500 ms
    reg.accepted("early", early, Accepted("early", 5, 0, "interactive", expires_ms=500))
    assert early.choice_tokens is None
    reg.streamed(reg.get("decoding"), TextDelta("decoding", "ab", (1, 2), 0), T0 + 0.25)
    reg.streamed(reg.get("decoding"), TextDelta("decoding", "c", (3,), 1), T0 + 0.5)
    reg.event(Finished("done", "deadline", Usage(5, 1, 1)))      # ended in time
    assert reg.get("decoding").choice_tokens == {0: 2, 1: 1}
    assert reg.get("decoding").clock.first_token == T0 + 0.25

    assert reg.overdue(T0 + 0.5 + LATE_GRACE_S - 1e-6) is None
    assert reg.overdue(T0 + 0.5 + LATE_GRACE_S) == ("early", Rejected(
        "early", "deadline_expired", "no first token within its deadline; the engine did "
        "not end it in time"))
    reg.close("early")
    assert reg.overdue(T0 + 1.0 + LATE_GRACE_S - 1e-6) is None
    now = T0 + 1.0 + LATE_GRACE_S
    assert reg.overdue(now) == ("decoding", Finished(      # due together: by request id
        "decoding", "deadline", Usage(5, 3, 1),
        choices=(ChoiceEnd(0, "deadline", 2), ChoiceEnd(1, "deadline", 1))))
    reg.close("decoding")
    assert reg.overdue(now) == ("waiting", Rejected(
        "waiting", "deadline_expired", "no first token within its end-to-end deadline; "
        "the engine did not end it in time"))
    reg.close("waiting")
    assert reg.overdue(now) is None and reg.expiry == []     # "done" passed over


def test_a_first_token_in_time_ends_the_ttft_watch_but_not_the_end_to_end_one():
    reg = Registry()
    reg.open("r", request())
    req = reg.get("r")
    reg.accepted("r", req, Accepted("r", 5, 0, "interactive", expires_ms=500,
                                    e2e_deadline_ms=2000))
    reg.streamed(req, TextDelta("r", "a", (7,), 0), T0 + 0.4)
    assert reg.overdue(T0 + 0.5 + LATE_GRACE_S) is None
    assert reg.overdue(T0 + 2.0 + LATE_GRACE_S) == ("r", cut_at_deadline(
        "r", req.accepted, req.choice_tokens))
    assert cut_at_deadline("r", None, req.choice_tokens) == Finished(
        "r", "deadline", Usage(0, 1, 0), choices=(ChoiceEnd(0, "deadline", 1),))


def test_a_streamed_delta_keeps_the_completion_when_it_is_recorded():
    req = request()
    req.completion = []
    Registry.streamed(req, TextDelta("r", "he", (1,), 0), T0 + 1)
    Registry.streamed(req, TextDelta("r", "llo", (2,), 0), T0 + 2)
    assert req.completion == ["he", "llo"] and req.clock.last_token == T0 + 2
