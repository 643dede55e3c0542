"""The SDK asks for batched events (``Submit.batch_events``) and reads an ``Events`` frame
as the events it holds, in order, each routed to its own stream: a fake server on the
real wire (ZeroMQ ROUTER, msgspec) answers two requests with one frame per step."""
from __future__ import annotations

import anyio
import zmq

from bus.socket import BusSocket
from schemas.client import (
    Accepted,
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
    """Answer heartbeats; once two requests are in, run them in three 'steps', one frame
    each for both requests."""
    who = None
    while len(submits) < 2:
        msg = await sock.recv()
        match msg.body:
            case Heartbeat():
                await sock.send(ServerHeartbeat(1), to=msg.identity)
            case Submit() as sub:
                submits.append(sub)
                who = msg.identity
    a, b = (s.request_id for s in submits)
    await sock.send(Events([Accepted(a, 3), Accepted(b, 3)]), to=who)
    for step in range(2):
        await sock.send(Events([TextDelta(a, f"a{step} ", (10 + step,)),
                                TextDelta(b, f"b{step} ", (20 + step,))]), to=who)
    await sock.send(Events([Finished(a, "length", Usage(3, 2)),
                            TextDelta(b, "b2", (22,)), Finished(b, "length", Usage(3, 3))]),
                    to=who)
    while True:                               # heartbeats until the client closes
        msg = await sock.recv()
        if isinstance(msg.body, Heartbeat):
            await sock.send(ServerHeartbeat(1), to=msg.identity)


def test_events_frames_reach_each_stream_in_order(tmp_path):
    endpoint = f"ipc://{tmp_path}/engine.sock"
    submits: list[Submit] = []

    async def main():
        server = BusSocket(zmq.ROUTER, "clients", ClientMsg).bind(endpoint)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_serve, server, submits)
                async with AsyncClient(endpoint, engine_timeout=5) as client:
                    results = {}

                    async def one(name):
                        results[name] = await client.generate(name, max_tokens=3)

                    with anyio.fail_after(10):
                        async with anyio.create_task_group() as reqs:
                            reqs.start_soon(one, "first")
                            await anyio.wait_all_tasks_blocked()
                            reqs.start_soon(one, "second")
                tg.cancel_scope.cancel()
        finally:
            server.close()
        return results

    results = anyio.run(main)
    assert [s.batch_events for s in submits] == [True, True]
    first, second = results["first"], results["second"]
    assert first.text == "a0 a1 " and list(first.token_ids) == [10, 11]
    assert second.text == "b0 b1 b2" and list(second.token_ids) == [20, 21, 22]
    assert first.finish_reason == second.finish_reason == "length"
