"""The router service wired up, in-process over ipc sockets, in front of two scripted
replicas that speak the client protocol (each answers heartbeats and load queries, runs a
request to its end in three frames, and the first refuses requests named ``busy-*`` for
load): relay, the reroute after a refusal, a client's cancel, the status, a replica added
and one retired and let go, and a malformed frame. Whole engines behind a router:
tests/e2e/test_router.py."""
from __future__ import annotations

import anyio
import pytest
import zmq
import zmq.asyncio

from bus.codec import Codec, encode
from components.router.service import RouterService
from schemas.client import (
    Accepted,
    Cancel,
    Cancelled,
    ChangeReplicas,
    ClientMsg,
    ComponentStatus,
    Finished,
    Heartbeat,
    ProtocolError,
    Rejected,
    ReplicaAddress,
    ReplicasChanged,
    ServerHeartbeat,
    ServerMsg,
    StatusQuery,
    StatusReport,
    Submit,
    TextDelta,
    Usage,
)
from schemas.config import ReplicaSpec, RouterConfig, Topology, WeirConfig

REPLIES = Codec(ServerMsg)


async def replica(ctx: zmq.asyncio.Context, address: str, refuses: bool,
                  heard: list[str]) -> None:
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.bind(address)
    codec = Codec(ClientMsg)
    try:
        while True:
            who, data = await sock.recv_multipart()
            body = codec.decode(data).body
            heard.append(type(body).__name__)
            match body:
                case Heartbeat():
                    out: list = [ServerHeartbeat(7)]
                case StatusQuery(query_id=q):
                    out = [StatusReport(q, (ComponentStatus("admission", 1, True, "ready", 0,
                                                            0.0, {"predicted_queue_s": 0.0}),))]
                case Submit(request_id=rid) if rid.startswith("busy") and refuses:
                    out = [Rejected(rid, "overloaded", "full", 1.0)]
                case Submit(request_id=rid) if rid.startswith("slow"):
                    out = []                                   # runs until cancelled
                case Submit(request_id=rid):
                    out = [Accepted(rid, 3, 0, "interactive"), TextDelta(rid, "hi", (5,), 0),
                           Finished(rid, "stop", Usage(3, 1, 0))]
                case Cancel(request_id=rid):
                    out = [Cancelled(rid, "cancelled")]      # swallowed by the router
                case _:
                    out = []
            for m in out:
                await sock.send_multipart([who, encode(m)])
    finally:
        sock.close(0)


@pytest.mark.anyio
async def test_the_router_service(tmp_path):
    ctx = zmq.asyncio.Context()
    heard: dict[str, list[str]] = {"a": [], "b": [], "c": []}
    address = {n: f"ipc://{tmp_path}/{n}.sock" for n in heard}
    svc = RouterService(WeirConfig(
        Topology(run_dir=str(tmp_path), client_endpoint=f"ipc://{tmp_path}/client.sock"),
        router=RouterConfig(replicas=(ReplicaSpec("a", address["a"]),
                                      ReplicaSpec("b", address["b"])))))
    await svc.setup()
    client = ctx.socket(zmq.DEALER)
    client.linger = 0
    client.connect(svc.topology.client_endpoint)

    async def send(body) -> None:
        await client.send(encode(body))

    async def replies(n: int) -> list:
        with anyio.fail_after(10):
            return [REPLIES.decode(await client.recv()).body for _ in range(n)]

    try:
        async with anyio.create_task_group() as tg:
            for name, refuses in (("a", True), ("b", False), ("c", False)):
                tg.start_soon(replica, ctx, address[name], refuses, heard[name])
            tg.start_soon(svc.run)
            with anyio.fail_after(10):
                while not all(r.healthy and r.report for r in svc.members):
                    await anyio.sleep(0.02)

            await send(Heartbeat())
            assert await replies(1) == [ServerHeartbeat(svc.instance, False)]

            await send(Submit("x1", prompt="hello"))       # equal replicas: "a", by name
            assert [type(m) for m in await replies(3)] == [Accepted, TextDelta, Finished]
            assert svc.members["a"].counts["routed"] == 1

            await send(Submit("busy-1", prompt="hello", deadline_ms=5000))
            got = await replies(3)
            assert [type(m) for m in got] == [Accepted, TextDelta, Finished]
            assert svc.counts["rerouted"] == 1 and svc.members["b"].counts["routed"] == 1
            assert svc.members["a"].counts["rerouted.overloaded"] == 1

            await send(Submit("slow-1", prompt="hello"))
            with anyio.fail_after(10):
                while "slow-1" not in svc.flights or not svc.flights["slow-1"].replica:
                    await anyio.sleep(0.02)
            holder = svc.flights["slow-1"].replica
            await send(Cancel("slow-1"))
            assert await replies(1) == [Cancelled("slow-1", "cancelled by client")]
            with anyio.fail_after(10):           # the replica's own Cancelled is swallowed
                while svc.flights:
                    await anyio.sleep(0.02)
            assert "Cancel" in heard[holder]

            await send(StatusQuery("q"))
            status = (await replies(1))[0]
            assert [c.name for c in status.components] == ["a/admission", "b/admission"]

            await send(ChangeReplicas("c1", add=(ReplicaAddress("c", address["c"]),),
                                      remove=("b",)))
            assert await replies(1) == [ReplicasChanged("c1", None, ("a", "c"), ("b",),
                                                          {"a": "default", "b": "default",
                                                           "c": "default"})]
            with anyio.fail_after(10):           # b has nothing open: it is let go
                while "b" in svc.links or not svc.members["c"].healthy:
                    await anyio.sleep(0.02)
            assert list(svc.members.replicas) == ["a", "c"]
            assert svc.counts["replicas_let_go"] == 1

            await client.send(b"\x93not a frame")
            assert isinstance((await replies(1))[0], ProtocolError)
            tg.cancel_scope.cancel()
    finally:
        svc.close()
        client.close(0)
        ctx.term()
