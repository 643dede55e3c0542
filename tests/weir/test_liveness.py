"""With no engine at the endpoint, nothing the SDK does waits forever: a request fails
with engine_unreachable after ``engine_timeout``, and status times out."""
import time

import anyio
import pytest

from weir import AsyncClient, RequestFailed, RequestTimeout


def test_no_engine_fails_requests_and_status_in_bounded_time(tmp_path):
    async def main():
        start = time.monotonic()
        async with AsyncClient(f"ipc://{tmp_path}/nobody.sock", engine_timeout=0.5) as c:
            with pytest.raises(RequestFailed) as err:
                await c.generate("hi", max_tokens=2)
            failed_after = time.monotonic() - start
            with pytest.raises(RequestTimeout):
                await c.status(timeout=0.5)
        return err.value.reason, failed_after

    reason, failed_after = anyio.run(main)
    assert reason.startswith("engine_unreachable") and failed_after < 5


def test_a_first_request_is_failed_when_its_streamer_restarts_before_any_answer(tmp_path):
    """The client learns the streamer's instance before its first submit: a streamer that
    takes the request and is replaced (a new instance answers the heartbeats) before the
    client has heard from it fails the request ``engine_restarted``; a request sent to an
    instance never known would wait for a terminal that no streamer will send."""
    import zmq

    from bus.socket import BusSocket
    from schemas.client import ClientMsg, Heartbeat, ServerHeartbeat, Submit

    endpoint = f"ipc://{tmp_path}/engine.sock"
    seen: list[str] = []

    async def serve(sock: BusSocket) -> None:
        instance = 1
        while True:
            msg = await sock.recv()
            if isinstance(msg.body, Heartbeat):
                seen.append(f"heartbeat->{instance}")
                await sock.send(ServerHeartbeat(instance), to=msg.identity)
            elif isinstance(msg.body, Submit):      # taken, then the streamer "restarts"
                seen.append("submit")
                instance = 2

    async def main():
        server = BusSocket(zmq.ROUTER, "clients", ClientMsg).bind(endpoint)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve, server)
                async with AsyncClient(endpoint, engine_timeout=5) as client:
                    with anyio.fail_after(10), pytest.raises(RequestFailed) as err:
                        await client.generate("hi", max_tokens=4)
                tg.cancel_scope.cancel()
        finally:
            server.close()
        return err.value.reason

    reason = anyio.run(main)
    assert reason.startswith("engine_restarted")
    assert seen[:2] == ["heartbeat->1", "submit"]
