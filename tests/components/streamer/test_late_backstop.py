"""The streamer's backstop for the engine's late ends: ``LATE_GRACE_S`` past a request's
end-to-end bound (``Accepted.e2e_deadline_ms``) with its end lost, it ends the request
itself, ``deadline_expired`` with no first token, else finish reason ``deadline`` with the
usage its client was streamed, tells the engine to stop, and counts it; a request whose
end came in time is not touched. The service as it is set up, over ipc sockets in a
temporary directory: a DEALER client reads what the requests' client is sent and a PULL
bound as the tokenizer's inbox reads what the engine is told; exact monotonic clocks."""
from __future__ import annotations

import anyio
import pytest
import zmq
from opentelemetry.trace import INVALID_SPAN

from bus.codec import Codec
from components.streamer.registry import LATE_GRACE_S, Active
from components.streamer.service import StreamerService
from components.streamer.slo import RequestClock
from schemas.client import ServerHeartbeat, ServerMsg
from schemas.config import Topology, WeirConfig
from schemas.wire import (
    Accepted,
    CancelRequest,
    ChoiceEnd,
    Finished,
    Rejected,
    SamplingParams,
    TextDelta,
    TokenizerMsg,
    Usage,
)
from tests import messages as msgs

T0 = 100.0          # every request's arrival, monotonic seconds


class Ends:
    """The streamer set up in ``run_dir``, its client and the tokenizer's inbox."""

    def __init__(self, run_dir) -> None:
        self.svc = StreamerService(WeirConfig(Topology(
            run_dir=str(run_dir), client_endpoint=f"ipc://{run_dir}/clients.sock")))
        self.ctx = zmq.Context()
        self.client = self.ctx.socket(zmq.DEALER)
        self.client.setsockopt(zmq.IDENTITY, b"client")
        self.tokenizer = self.ctx.socket(zmq.PULL)
        for s in (self.client, self.tokenizer):
            s.linger = 0
        self.tokenizer.bind(self.svc.topology.inbox("tokenizer", bind=True))

    async def start(self, *requests: tuple[str, int]) -> StreamerService:
        """Set up, holding ``(request id, n)`` requests, each submitted at ``T0`` and not
        yet accepted, for the client."""
        await self.svc.setup()
        self.client.connect(self.svc.topology.client_endpoint)
        with anyio.fail_after(5):        # until the ROUTER knows the client (else it drops)
            while True:
                await self.svc.clients.send(ServerHeartbeat(0), to=b"client")
                if self.client.poll(20):
                    self.client.recv()
                    break
        for rid, n in requests:
            req = Active(b"client", "t", 0, RequestClock(T0, None, "interactive"),
                         INVALID_SPAN)
            req.pending = msgs.new_request(rid, "t", "hi", None, SamplingParams(n=n), 0)
            self.svc.registry.open(rid, req)
        return self.svc

    @staticmethod
    async def _read(sock, codec: Codec, count: int) -> list:
        out = []
        with anyio.fail_after(5):
            while len(out) < count:
                if sock.poll(0):
                    body = codec.decode(sock.recv()).body
                    if not isinstance(body, ServerHeartbeat):     # start()'s handshake
                        out.append(body)
                else:
                    await anyio.sleep(0.005)
        while sock.poll(50):            # nothing more
            assert isinstance(codec.decode(sock.recv()).body, ServerHeartbeat)
        return out

    async def to_client(self, count: int) -> list:
        return await self._read(self.client, Codec(ServerMsg), count)

    async def to_engine(self, count: int) -> list:
        return await self._read(self.tokenizer, Codec(TokenizerMsg), count)

    def close(self) -> None:
        self.svc.close()
        self.client.close(0)
        self.tokenizer.close(0)
        self.ctx.term()


@pytest.mark.anyio
async def test_a_lost_end_is_ended_by_the_backstop_at_the_bound_plus_grace(tmp_path):
    ends = Ends(tmp_path)
    try:
        svc = await ends.start(("waiting", 1), ("decoding", 2), ("done", 1))
        for rid in ("waiting", "decoding", "done"):
            await svc._on_event(Accepted(rid, 5, 1, "interactive", e2e_deadline_ms=1000))
        await svc._on_event(TextDelta("decoding", "ab", (1, 2), 0))
        await svc._on_event(TextDelta("decoding", "c", (3,), 1))
        await svc._on_event(TextDelta("done", "z", (9,), 0))
        await svc._on_event(Finished("done", "deadline", Usage(5, 1, 1)))   # the engine's
        assert len(await ends.to_client(7)) == 7
        await svc._expire_late(T0 + 1.0 + LATE_GRACE_S - 1e-6)
        assert len(svc.registry) == 2
        await svc._expire_late(T0 + 1.0 + LATE_GRACE_S)
        assert await ends.to_client(2) == [         # due together: in request id order
            Finished("decoding", "deadline", Usage(5, 3, 1),
                     choices=(ChoiceEnd(0, "deadline", 2), ChoiceEnd(1, "deadline", 1))),
            Rejected("waiting", "deadline_expired", "no first token within its end-to-end "
                     "deadline; the engine did not end it in time")]
        assert await ends.to_engine(2) == [CancelRequest("decoding", "deadline"),
                                           CancelRequest("waiting", "deadline_expired")]
        assert not len(svc.registry) and not svc.registry.expiry
        assert (svc.counts["deadline_expired"], svc.counts["deadline_finished"]) == (1, 1)
        slo = svc.slo.stats()
        assert (slo["goodput.missed.expired.interactive"],
                slo["goodput.missed.deadline.interactive"]) == (1, 2)     # "done" is the 2nd
    finally:
        ends.close()


@pytest.mark.anyio
async def test_a_request_without_a_bound_keeps_no_counts_and_no_entry(tmp_path):
    ends = Ends(tmp_path)
    try:
        svc = await ends.start(("free", 1))
        await svc._on_event(Accepted("free", 5, 0, "interactive"))
        await svc._on_event(TextDelta("free", "a", (1,), 0))
        await svc._expire_late(T0 + 3600)
        assert not svc.registry.expiry and svc.registry.get("free").choice_tokens is None
        assert [type(e) for e in await ends.to_client(2)] == [Accepted, TextDelta]
        assert await ends.to_engine(0) == []
    finally:
        ends.close()


@pytest.mark.anyio
async def test_a_request_ended_while_a_loop_awaited_gets_no_second_terminal(tmp_path):
    """The drain, client-gone and restart loops end requests from a list taken before
    their sends: the engine's terminal can land in between. The loop's end is then no
    end at all (it raised KeyError and killed the loop)."""
    ends = Ends(tmp_path)
    try:
        svc = await ends.start(("r", 1))
        await svc._on_event(Accepted("r", 5, 0, "interactive"))
        await svc._on_event(Finished("r", "stop", Usage(5, 1, 1)))      # the engine's end
        await svc.cancel("r", "client disconnected")                    # the loop's, late
        assert [type(e) for e in await ends.to_client(2)] == [Accepted, Finished]
        assert await ends.to_engine(0) == []
        assert not len(svc.registry) and svc.counts["cancelled"] == 0
    finally:
        ends.close()
