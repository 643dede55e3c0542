"""An in-process gateway (the real app, protocol guards and uvicorn) over a fake engine
client, for HTTP-level tests that need no model."""
from __future__ import annotations

import contextlib
import socket
from typing import Any

import anyio
import uvicorn

from components.gateway.app import build_app
from components.gateway.auth import Authenticator
from components.gateway.protocol import guarded_protocol
from components.gateway.service import _Server
from components.gateway.state import GatewayState
from schemas.client import Accepted, ComponentStatus, StatusReport, TextDelta, Usage
from schemas.config import GatewayConfig
from weir.client import Choice, Completion
from weir.errors import RequestRejected


class FakeStream:
    """Yields ``deltas`` TextDeltas of ``text`` as fast as it is read, then finishes
    (``finish_reason``); or, with ``reject``, raises it where the engine's rejection would
    surface. ``accepted`` is what admission granted, known (as with the SDK) before the
    first delta."""

    def __init__(self, rid: str, deltas: int, text: str, delay: float = 0.0,
                 accepted: Accepted | None = None,
                 reject: RequestRejected | None = None, finish_reason: str = "length") -> None:
        self.request_id, self.deltas, self.text, self.delay = rid, deltas, text, delay
        self.finish_reason = finish_reason
        self.granted = accepted or Accepted(rid, 3, 0, "default", 16)
        self.reject = reject
        self.cancelled = anyio.Event()
        self.closed = anyio.Event()
        self.accepted: Accepted | None = None
        self.result = None

    def __aiter__(self):
        return self._events()

    async def _events(self):
        try:
            await anyio.sleep(getattr(self, "first_delay", 0.0))       # queue + prefill
            if self.reject is not None:
                raise self.reject
            self.accepted = acc = self.granted
            for _ in range(self.deltas):
                await anyio.sleep(self.delay)
                yield TextDelta(self.request_id, self.text, (1,), 0)
            text = self.text * self.deltas
            self.result = Completion(
                self.request_id, text, [1] * self.deltas, self.finish_reason,
                Usage(3, self.deltas), None, 0.0,
                choices=[Choice(0, text, [1] * self.deltas, self.finish_reason)],
                service_class=acc.service_class, degraded=acc.degraded,
                max_tokens=acc.max_tokens, queued_s=acc.queued_s)
        finally:
            self.closed.set()

    async def cancel(self) -> None:
        self.cancelled.set()

    async def abandon(self) -> None:          # the caller left; no idempotency key: cancel
        await self.cancel()


class FakeClient:
    def __init__(self, deltas: int = 3, text: str = "ok", stats: dict | None = None,
                 delay: float = 0.0, first_delay: float = 0.0,
                 tenants: dict | None = None, accepted: Accepted | None = None,
                 reject: RequestRejected | None = None, reject_from: int = 0,
                 reject_after: float | None = None, states: dict | None = None,
                 finish_reason: str = "length") -> None:
        self.states = states or {}                # component -> its state, else "ready"
        self.deltas, self.text, self.delay, self.first_delay = deltas, text, delay, first_delay
        self.accepted, self.reject = accepted, reject     # for every stream it opens
        self.reject_from = reject_from                    # ... from this one on
        self.reject_after = reject_after                  # seconds to a refusal (first_delay)
        self.stats = stats or {}
        self.finish_reason = finish_reason        # how every stream ends
        self.tenants = tenants or {}              # component -> {tenant: TenantUsage}
        self.submitted: list[dict[str, Any]] = []
        self.streams: list[FakeStream] = []

    async def stream(self, request_id: str, tenant: str, **kwargs: Any) -> FakeStream:
        self.submitted.append({"tenant": tenant, **kwargs})
        s = FakeStream(request_id, self.deltas, self.text, self.delay, self.accepted,
                       self.reject if len(self.streams) >= self.reject_from else None,
                       self.finish_reason)
        s.first_delay = self.first_delay
        if s.reject is not None and self.reject_after is not None:
            s.first_delay = self.reject_after
        self.streams.append(s)
        return s

    async def status(self, timeout: float = 5.0) -> StatusReport:
        return StatusReport("q", tuple(ComponentStatus(
            name, 1, self.states.get(name, "ready") != "dead",
            self.states.get(name, "ready"), 0, 0.0, stats, self.tenants.get(name, {}))
            for name, stats in self.stats.items()))


class Gateway:
    def __init__(self, port: int, client: FakeClient, protocol: type) -> None:
        self.port, self.client, self.protocol = port, client, protocol
        self.url = f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def serve(client: FakeClient, keys: tuple = (), max_model_len: int = 2048, **cfg: Any):
    """Run the gateway app under uvicorn with the guarded protocol on a free port of
    ``host`` (loopback by default)."""
    cfg.setdefault("send_buffer_bytes", 0)        # the kernel's and the loop's own defaults
    config = GatewayConfig(**cfg)
    state = GatewayState(client, Authenticator(keys), "m", config, max_model_len)
    sock = socket.socket()
    sock.bind((config.host, 0))
    protocol = guarded_protocol(config)
    server = _Server(uvicorn.Config(
        build_app(state), log_level="critical", access_log=False, lifespan="off",
        http=protocol,
        limit_concurrency=config.max_connections, timeout_graceful_shutdown=1))
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: server.serve(sockets=[sock]))
        while not server.started:
            await anyio.sleep(0.01)
        try:
            yield Gateway(sock.getsockname()[1], client, protocol)
        finally:
            server.should_exit = True
            server.force_exit = True
    sock.close()
