"""Late work ended. Two bounds, one heap:

- A request whose class drops late work (``Admitted.drop_late``) and whose TTFT deadline
  passes before its first token ends ``deadline_expired``, waiting or mid-prefill. Serving
  it would only spend the engine on an answer its client no longer waits for (the first
  seed: "serving doomed work is worse").
- A request with an end-to-end bound (``Admitted.header.e2e_deadline_ns``: its own, clamped to
  its class's ``e2e_slo_ms``) ends there wherever it is: ``deadline_expired`` if it has no
  first token yet, else each open choice finishes with reason ``deadline`` and its usage
  (its client has the output so far, as with ``length``).

Either way its KV goes back at once and no step planned from then on computes for it (one
already in flight may: its sample is discarded).

The bounds are kept in a heap, so each message looks only at the ones due: no scan of the
queue on the step path. An entry names the sequence it was made for, so one left behind
by a request that ended is let go even if a later request reuses its id. Pure and
clock-free: the scheduler loop checks at every message it handles, the replay simulator at
every message the scheduler would get, each with that message's clock."""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, NamedTuple

from components.scheduler.output import Outcome
from schemas.wire import Admitted, Rejected

if TYPE_CHECKING:
    from components.scheduler.core import SchedulerCore
    from components.scheduler.sequence import Seq


class Dropped(NamedTuple):
    """One request ended late: the ``Rejected`` its client gets (None: it finished
    ``deadline``, its end is in the ``Outcome``'s tokens), and for the log where it was, which
    bound ended it and how far past it."""

    request_id: str
    rejected: Rejected | None
    where: str                 # "before prefill" | "mid-prefill" | "decoding"
    bound: str                 # "ttft" | "e2e"
    overdue_ms: float          # the clock past the bound when it was ended


class LateDrops:
    def __init__(self) -> None:
        # (due, request id, its first seq's id, end-to-end?): a heap
        self._due: list[tuple[int, str, int, bool]] = []
        self.dropped = 0            # ended deadline_expired (either bound)
        self.finished = 0           # ended at the end-to-end bound with finish reason deadline

    def __len__(self) -> int:
        return len(self._due)

    def watch(self, req: Admitted, seq: Seq) -> None:
        """``req`` was just added to the core as ``seq``: keep its TTFT deadline if its class
        drops late work, and its end-to-end bound if it has one."""
        if req.drop_late and seq.deadline_ns:
            heapq.heappush(self._due, (seq.deadline_ns, req.request_id, seq.seq_id, False))
        if req.header.e2e_deadline_ns is not None:
            heapq.heappush(self._due, (req.header.e2e_deadline_ns,
                                       req.request_id, seq.seq_id, True))

    def due(self, now_ns: int) -> bool:
        return bool(self._due) and self._due[0][0] <= now_ns

    def drop(self, core: SchedulerCore, now_ns: int) -> tuple[Outcome, list[Dropped]]:
        """End every watched request due by ``now_ns``: what ending it released, forgot and
        emitted, and the ends. One that ended already, or (TTFT) whose first token came in
        time, is let go."""
        out, dropped = Outcome(), []
        while self.due(now_ns):
            due_ns, rid, seq_id, whole = heapq.heappop(self._due)
            seq = core.by_request.get(rid)
            if seq is None or seq.seq_id != seq_id:        # it ended (every choice)
                continue
            started = any(s.first_token_ns for s in seq.group)
            overdue_ms = (now_ns - due_ns) / 1e6
            if started and whole:
                ended = core.end_at_deadline(rid, now_ns)
                out.tokens += ended.tokens
                out.released += ended.released
                self.finished += 1
                dropped.append(Dropped(rid, None, "decoding", "e2e", overdue_ms))
                continue
            if started:
                continue
            where = "mid-prefill" if seq.num_computed else "before prefill"
            cancelled = core.cancel(rid)
            out.released += cancelled.released
            out.forget += cancelled.forget
            self.dropped += 1
            bound = "end-to-end deadline" if whole else "deadline"
            dropped.append(Dropped(rid, Rejected(
                rid, "deadline_expired",
                f"no first token within its {bound} of {(due_ns - seq.arrival_ns) / 1e6:.0f} "
                f"ms (dropped {where}, {(now_ns - seq.arrival_ns) / 1e6:.0f} ms after "
                f"arrival)"), where, "e2e" if whole else "ttft", overdue_ms))
        return out, dropped
