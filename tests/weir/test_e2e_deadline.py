"""The SDK's end-to-end deadline: ``generate(e2e_deadline_ms=...)`` sends it in the
``Submit``, and a request the engine cut at it completes with finish reason ``deadline``,
its text so far and its usage (a fake server on the real wire: ZeroMQ ROUTER, msgspec)."""
from __future__ import annotations

import anyio
import zmq

from bus.socket import BusSocket
from schemas.client import (
    Accepted,
    ChoiceEnd,
    ClientMsg,
    Events,
    Finished,
    Heartbeat,
    ServerHeartbeat,
    Submit,
    TextDelta,
    Usage,
)
from weir import AsyncClient


async def _serve(sock: BusSocket, submits: list[Submit]) -> None:
    while True:
        msg = await sock.recv()
        match msg.body:
            case Heartbeat():
                await sock.send(ServerHeartbeat(1), to=msg.identity)
            case Submit() as sub:
                submits.append(sub)
                rid = sub.request_id
                await sock.send(Events([
                    Accepted(rid, 3, 0, "interactive", 500, e2e_deadline_ms=250),
                    TextDelta(rid, "cut ", (10,)), TextDelta(rid, "short", (11,)),
                    Finished(rid, "deadline", Usage(3, 2),
                             choices=(ChoiceEnd(0, "deadline", 2),))]), to=msg.identity)


def test_the_bound_is_sent_and_a_deadline_finish_is_a_completion(tmp_path):
    endpoint = f"ipc://{tmp_path}/engine.sock"
    submits: list[Submit] = []

    async def main():
        server = BusSocket(zmq.ROUTER, "clients", ClientMsg).bind(endpoint)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_serve, server, submits)
                async with AsyncClient(endpoint, engine_timeout=5) as client:
                    with anyio.fail_after(10):
                        done = await client.generate("hi", max_tokens=500,
                                                     e2e_deadline_ms=250)
                tg.cancel_scope.cancel()
        finally:
            server.close()
        return done

    done = anyio.run(main)
    [sub] = submits
    assert (sub.e2e_deadline_ms, sub.deadline_ms, sub.params.max_tokens) == (250, None, 500)
    assert (done.finish_reason, done.text, done.usage) == ("deadline", "cut short", Usage(3, 2))
    assert [c.finish_reason for c in done.choices] == ["deadline"]
