"""A live config change on the router service, in-process in front of two scripted replicas
(tests/components/router/test_service.py): the new policy, weights and budgets are in
force from the next decision, a request in flight keeps its replica and its tenant's
count and bucket, a restart-only field is refused, and a router set up again in the same
run directory goes on with the version in force."""
from __future__ import annotations

import anyio
import pytest
import zmq
import zmq.asyncio

from bus.codec import encode
from components.router.service import RouterService
from schemas.client import Cancel, Cancelled, ConfigAnswer, ConfigCommand, Submit
from schemas.config import ReplicaSpec, RouterConfig, TenantConfig, Topology, WeirConfig
from tests.components.router.test_service import REPLIES, replica


def config(tmp_path, addresses: dict[str, str]) -> WeirConfig:
    return WeirConfig(
        Topology(run_dir=str(tmp_path), client_endpoint=f"ipc://{tmp_path}/client.sock"),
        router=RouterConfig(replicas=tuple(ReplicaSpec(n, a) for n, a in addresses.items()),
                            tenants=(TenantConfig("acme", max_outstanding=8,
                                                  token_rate=100.0, token_burst=1000.0),)))


@pytest.mark.anyio
async def test_a_config_change_on_the_router_service(tmp_path):
    ctx = zmq.asyncio.Context()
    heard: dict[str, list[str]] = {"a": [], "b": []}
    address = {n: f"ipc://{tmp_path}/{n}.sock" for n in heard}
    svc = RouterService(config(tmp_path, address))
    await svc.setup()
    client = ctx.socket(zmq.DEALER)
    client.linger = 0
    client.connect(svc.topology.client_endpoint)

    async def ask(body) -> object:
        await client.send(encode(body))
        with anyio.fail_after(10):
            return REPLIES.decode(await client.recv()).body

    try:
        async with anyio.create_task_group() as tg:
            for name in heard:
                tg.start_soon(replica, ctx, address[name], False, heard[name])
            tg.start_soon(svc.run)
            with anyio.fail_after(10):
                while not all(r.healthy and r.report for r in svc.members):
                    await anyio.sleep(0.02)
            await client.send(encode(Submit("slow-1", prompt="hello", tenant="acme")))
            with anyio.fail_after(10):
                while "slow-1" not in svc.flights or not svc.flights["slow-1"].replica:
                    await anyio.sleep(0.02)
            holder = svc.flights["slow-1"].replica
            level = svc.budgets.buckets["acme"].level

            answer = await ask(ConfigCommand(
                "c1", "apply", '[router]\npolicy = "round_robin"\nweights = { queue = 4.0 }\n'
                'tenants = [{ name = "acme", max_outstanding = 1, token_rate = 50.0, '
                'weight = 2.0 }]\n', actor="t"))
            assert isinstance(answer, ConfigAnswer) and answer.error is None
            assert (answer.current.version, answer.current.changed) == (
                1, ("router.policy", "router.tenants", "router.weights"))
            assert svc.routing.rc.policy == "round_robin" == svc.rc.policy
            assert svc.routing.rc.weights.queue == 4.0
            assert svc.fleetq.vtc.weights == {"acme": 2.0}
            # in flight: the same replica, counted once against the new cap, its bucket kept
            assert svc.flights["slow-1"].replica == holder and svc.budgets.own["acme"] == 1
            bucket = svc.budgets.buckets["acme"]
            assert (bucket.rate, bucket.burst) == (50.0, 50.0) and bucket.level <= level
            assert svc.stats()["config_version"] == 1

            refused = await ask(ConfigCommand("c2", "apply", "[router]\nmax_sessions = 9\n"))
            assert refused.error == ("config not applied: router.max_sessions needs a "
                                     "restart (the session table is made at start)")
            assert refused.current.version == 1

            assert await ask(Cancel("slow-1")) == Cancelled("slow-1", "cancelled by client")
            tg.cancel_scope.cancel()
    finally:
        svc.close()
        client.close(0)
        ctx.term()

    again = RouterService(config(tmp_path, address))     # the router process restarted
    await again.setup()
    try:
        assert again.live.history.current.version == 1
        assert again.rc.policy == again.routing.rc.policy == "round_robin"
        assert again.budgets.tenants["acme"].max_outstanding == 1
    finally:
        again.close()
