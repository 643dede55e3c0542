"""The streamer's open requests, and the rule that each gets exactly one terminal message.

A request is open from its Submit (``open``) until its terminal: the engine's (``event``
with a ``Finished``, ``Rejected``, ``Cancelled`` or ``Failed``) or one the streamer
decides itself (``close``: a cancel, a drain's timeout, a component's restart, the late
backstop). Whichever comes first closes it; after that no request holds its id, so

- a second terminal is dropped and counted (``late_events``): the client has had its one;
- any other event after the terminal is dropped and counted too, and the first such event
  of an id asks the engine, once, to stop the work (``orphaned``: nobody waits for it).

The late backstop: the scheduler ends a request of a class that drops late work at its TTFT
deadline, and any request at its end-to-end bound; if that end is lost (a restart, a
dropped frame), the streamer ends it ``LATE_GRACE_S`` later (``overdue``) so its client
never waits past it. No sockets and no clock of its own: the service passes ``now``.
"""
from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from components.streamer.slo import RequestClock
from schemas.client import (
    Accepted,
    Cancelled,
    ChoiceEnd,
    Failed,
    Finished,
    Rejected,
    TextDelta,
    Usage,
)
from schemas.wire import NewRequest

TERMINAL = (Finished, Rejected, Cancelled, Failed)
# The scheduler drops a request whose class drops late work at its deadline, and ends one
# at its end-to-end bound; this streamer does too, this much later, so that a lost message
# (a restart, a dropped frame) cannot leave its client waiting past it
LATE_GRACE_S = 1.0
ORPHANS_KEPT = 4096                  # ids whose engine work was asked to stop, remembered


@dataclass
class Active:
    identity: bytes
    tenant: str
    arrival_ns: int
    clock: RequestClock
    span: Any = None                 # the request's root span in the engine
    delivery: Any = None             # "stream" span: first delta to terminal
    completion: list[str] | None = None   # only with telemetry.record_content
    pending: NewRequest | None = None     # until admission accepts it: replayable
    traceparent: str | None = None
    idempotent: bool = False
    batched: bool = False            # its client takes Events (Submit.batch_events)
    deterministic: bool = False      # its Accepted carries what it is pinned to
    # with an end-to-end bound (Accepted.e2e_deadline_ms): what the client has had, so the
    # backstop can finish it "deadline" with its usage (output tokens by choice)
    accepted: Accepted | None = None
    choice_tokens: Counter[int] | None = None


def cut_at_deadline(rid: str, accepted: Accepted | None, choice_tokens: Counter[int]) -> Finished:
    """The ``Finished`` the streamer ends a request with at its end-to-end bound when the
    engine's end did not come: every choice finish reason ``deadline``, the usage what the
    client was streamed."""
    prompt, cached = (accepted.prompt_tokens, accepted.cached_tokens) if accepted else (0, 0)
    ends = tuple(ChoiceEnd(i, "deadline", n) for i, n in sorted(choice_tokens.items()))
    return Finished(rid, "deadline", Usage(prompt, sum(choice_tokens.values()), cached),
                    choices=ends)


class Registry:
    """Open requests by id, how many each tenant holds, and the late backstop's heap."""

    def __init__(self) -> None:
        self._active: dict[str, Active] = {}
        self._per_tenant: Counter[str] = Counter()
        # (due, request id, end-to-end?): from Accepted's expires_ms and e2e_deadline_ms
        self.expiry: list[tuple[float, str, bool]] = []
        self._orphans: OrderedDict[str, None] = OrderedDict()
        self.late_events = 0             # events for a request nobody holds: dropped
        self.orphans_cancelled = 0       # ... of which the first of an id, not a terminal

    def __len__(self) -> int:
        return len(self._active)

    def __contains__(self, rid: str) -> bool:
        return rid in self._active

    def get(self, rid: str) -> Active | None:
        return self._active.get(rid)

    def requests(self) -> list[tuple[str, Active]]:
        """The open requests (a copy: the caller may close them as it goes)."""
        return list(self._active.items())

    def held_by(self, tenant: str) -> int:
        """How many open requests ``tenant`` holds."""
        return self._per_tenant[tenant]

    def open(self, rid: str, req: Active) -> None:
        assert rid not in self._active, rid          # the caller refuses a duplicate id
        self._active[rid] = req
        self._per_tenant[req.tenant] += 1

    def close(self, rid: str) -> Active:
        """``rid``'s terminal is being delivered: it is no longer open."""
        req = self._active.pop(rid)
        self._per_tenant[req.tenant] -= 1
        if not self._per_tenant[req.tenant]:    # an open endpoint's claimed names: no trail
            del self._per_tenant[req.tenant]
        return req

    def event(self, event: Any) -> Active | None:
        """An engine event: the open request it is for (closed, if the event is its
        terminal), or None when no request holds its id (it has had its terminal, or this
        streamer never knew it): the event is dropped and counted."""
        rid = event.request_id
        if rid not in self._active:
            self.late_events += 1
            return None
        return self.close(rid) if isinstance(event, TERMINAL) else self._active[rid]

    def orphaned(self, rid: str) -> bool:
        """Whether the engine should be told to stop ``rid``'s work, for which a
        non-terminal event came after its terminal: once per id (of the last
        ``ORPHANS_KEPT``)."""
        if rid in self._orphans:
            return False
        self._orphans[rid] = None
        if len(self._orphans) > ORPHANS_KEPT:
            self._orphans.popitem(last=False)
        self.orphans_cancelled += 1
        return True

    def accepted(self, rid: str, req: Active, event: Accepted) -> None:
        """Admission accepted ``rid``: it is no longer replayable, and the backstop watches
        its TTFT deadline (``expires_ms``, for a class that drops late work) and its
        end-to-end bound, each ``LATE_GRACE_S`` late, from when the streamer got it."""
        if event.expires_ms is not None:
            heapq.heappush(self.expiry, (req.clock.started + event.expires_ms / 1e3
                                         + LATE_GRACE_S, rid, False))
        if event.e2e_deadline_ms is not None:
            n = req.pending.params.n if req.pending is not None else 1
            req.accepted, req.choice_tokens = event, Counter(dict.fromkeys(range(n), 0))
            heapq.heappush(self.expiry, (req.clock.started + event.e2e_deadline_ms / 1e3
                                         + LATE_GRACE_S, rid, True))
        req.pending = None

    @staticmethod
    def streamed(req: Active, delta: TextDelta, now: float) -> None:
        """``delta`` goes to ``req``'s client at ``now``: its clock, and its tokens by
        choice when the backstop may have to finish it."""
        req.clock.token(now, delta.index)
        if req.choice_tokens is not None:
            req.choice_tokens[delta.index] += len(delta.token_ids)
        if req.completion is not None:
            req.completion.append(delta.text)

    def overdue(self, now: float) -> tuple[str, Rejected | Finished] | None:
        """The next request the backstop ends at ``now``, with its terminal (None: no
        more): ``deadline_expired`` with no first token by its TTFT deadline or its
        end-to-end bound; finish reason ``deadline``, with the usage it streamed, with
        tokens at its end-to-end bound. One whose end came in time is passed over."""
        while self.expiry and self.expiry[0][0] <= now:
            _, rid, whole = heapq.heappop(self.expiry)
            req = self._active.get(rid)
            if req is None or (req.clock.first_token is not None and not whole):
                continue
            if req.clock.first_token is None:
                return rid, Rejected(rid, "deadline_expired", "no first token within "
                                     f"its {'end-to-end ' if whole else ''}deadline; "
                                     "the engine did not end it in time")
            assert req.choice_tokens is not None        # set with its end-to-end bound
            return rid, cut_at_deadline(rid, req.accepted, req.choice_tokens)
        return None
