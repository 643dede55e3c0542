"""The streamer's backstop for the engine's late ends: ``LATE_GRACE_S`` past a request's
end-to-end bound (``Accepted.e2e_deadline_ms``) with its end lost, it ends the request
itself, ``deadline_expired`` with no first token, else finish reason ``deadline`` with the
usage its client was streamed, tells the engine to stop, and counts it; a request whose
end came in time is not touched. The service's own handlers, with recording sinks for its
sockets and exact monotonic clocks."""
from __future__ import annotations

from collections import Counter

import anyio
from opentelemetry.trace import INVALID_SPAN

from components.tenancy.retry import DrainRate
from components.streamer.service import LATE_GRACE_S, Active, StreamerService
from components.streamer.slo import RequestClock, SloStats
from schemas.config import ServiceClass
from schemas.wire import (Accepted, CancelRequest, ChoiceEnd, Finished, NewRequest, Rejected,
                          SamplingParams, TextDelta, Usage)

T0 = 100.0          # every request's arrival, monotonic seconds


class Sink:
    def __init__(self) -> None:
        self.sent: list = []

    async def send(self, msg, to=None, traceparent=None) -> None:
        self.sent.append(msg)


def streamer(*requests: tuple[str, int]) -> StreamerService:
    """A streamer holding ``(request id, n)`` requests, each submitted at ``T0`` and not
    yet accepted."""
    svc = StreamerService.__new__(StreamerService)
    svc.active, svc.per_tenant, svc.ends, svc.expiry = {}, Counter(), DrainRate(), []
    svc.counts = Counter()
    svc.slo = SloStats({"interactive": ServiceClass("interactive", ttft_slo_ms=3000)})
    svc.clients, svc.to_tokenizer = Sink(), Sink()
    for rid, n in requests:
        req = Active(b"client", "t", 0, RequestClock(T0, None, "interactive"), INVALID_SPAN)
        req.pending = NewRequest(rid, "t", "hi", None, SamplingParams(n=n), 0)
        svc.active[rid] = req
        svc.per_tenant["t"] += 1
    return svc


def test_a_lost_end_is_ended_by_the_backstop_at_the_bound_plus_grace():
    svc = streamer(("waiting", 1), ("decoding", 2), ("done", 1))

    async def run() -> None:
        for rid in ("waiting", "decoding", "done"):
            await svc._on_event(Accepted(rid, 5, 1, "interactive", e2e_deadline_ms=1000))
        await svc._on_event(TextDelta("decoding", "ab", (1, 2), 0))
        await svc._on_event(TextDelta("decoding", "c", (3,), 1))
        await svc._on_event(TextDelta("done", "z", (9,), 0))
        await svc._on_event(Finished("done", "deadline", Usage(5, 1, 1)))   # the engine's
        svc.clients.sent.clear()
        await svc._expire_late(T0 + 1.0 + LATE_GRACE_S - 1e-6)
        assert not svc.clients.sent and len(svc.active) == 2
        await svc._expire_late(T0 + 1.0 + LATE_GRACE_S)

    anyio.run(run)
    assert svc.clients.sent == [                 # due together: in request id order
        Finished("decoding", "deadline", Usage(5, 3, 1),
                 choices=(ChoiceEnd(0, "deadline", 2), ChoiceEnd(1, "deadline", 1))),
        Rejected("waiting", "deadline_expired", "no first token within its end-to-end "
                 "deadline; the engine did not end it in time")]
    assert svc.to_tokenizer.sent == [CancelRequest("decoding", "deadline"),
                                     CancelRequest("waiting", "deadline_expired")]
    assert not svc.active and not svc.expiry
    assert (svc.counts["deadline_expired"], svc.counts["deadline_finished"]) == (1, 1)
    slo = svc.slo.stats()
    assert (slo["goodput.missed.expired.interactive"],
            slo["goodput.missed.deadline.interactive"]) == (1, 2)     # "done" is the 2nd


def test_a_request_without_a_bound_keeps_no_counts_and_no_entry():
    svc = streamer(("free", 1))

    async def run() -> None:
        await svc._on_event(Accepted("free", 5, 0, "interactive"))
        await svc._on_event(TextDelta("free", "a", (1,), 0))
        await svc._expire_late(T0 + 3600)

    anyio.run(run)
    assert not svc.expiry and svc.active["free"].choice_tokens is None
    assert [type(e) for e in svc.clients.sent] == [Accepted, TextDelta]
