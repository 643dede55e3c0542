"""Late work dropped: a request whose class drops late work (``Admitted.drop_late``) and
whose TTFT deadline passes before its first token ends ``deadline_expired``, waiting or
mid-prefill. Its KV goes back at once and no step planned from then on computes for it
(one already in flight may: its sample is discarded). Serving it would only spend the
engine on an answer its client no longer waits for (the first seed: "serving doomed work
is worse").

The requests are kept by deadline in a heap, so each message looks only at the ones due:
no scan of the queue on the step path. Pure and clock-free: the scheduler loop checks at
every message it handles, the replay simulator at every message the scheduler would get,
each with that message's clock."""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, NamedTuple

from components.scheduler.output import Outcome
from schemas.wire import Admitted, Rejected

if TYPE_CHECKING:
    from components.scheduler.core import SchedulerCore
    from components.scheduler.sequence import Seq


class Dropped(NamedTuple):
    """One request dropped late: the ``Rejected`` its client gets, and for the log where
    it was and how far past its deadline."""

    rejected: Rejected
    where: str                 # "before prefill" | "mid-prefill"
    overdue_ms: float          # the clock past its deadline when it was dropped


class LateDrops:
    def __init__(self) -> None:
        self._due: list[tuple[int, str]] = []       # (deadline, request id), a heap
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._due)

    def watch(self, req: Admitted, seq: Seq) -> None:
        """``req`` was just added to the core as ``seq``: keep it if its class drops it."""
        if req.drop_late and seq.deadline_ns:
            heapq.heappush(self._due, (seq.deadline_ns, req.request_id))

    def due(self, now_ns: int) -> bool:
        return bool(self._due) and self._due[0][0] <= now_ns

    def drop(self, core: SchedulerCore, now_ns: int) -> tuple[Outcome, list[Dropped]]:
        """End every watched request due by ``now_ns`` that is still without a first token:
        what ending it released and forgot, and the drops. One that ended, or whose first
        token came in time, is let go."""
        out, dropped = Outcome(), []
        while self.due(now_ns):
            due_ns, rid = heapq.heappop(self._due)
            seq = core.by_request.get(rid)
            if seq is None or seq.ended or any(s.first_token_ns for s in seq.group):
                continue
            where = "mid-prefill" if seq.num_computed else "before prefill"
            cancelled = core.cancel(rid)
            out.released += cancelled.released
            out.forget += cancelled.forget
            self.dropped += 1
            dropped.append(Dropped(Rejected(
                rid, "deadline_expired",
                f"no first token within its deadline of {(due_ns - seq.arrival_ns) / 1e6:.0f} "
                f"ms (dropped {where}, {(now_ns - seq.arrival_ns) / 1e6:.0f} ms after "
                f"arrival)"), where, (now_ns - due_ns) / 1e6))
        return out, dropped
